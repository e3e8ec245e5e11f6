#pragma once
// Defining an opaque operator: one op node in every traced graph, with a
// generic Autograd kernel and an opaque backward op.
//
// define_op registers three operators (four with a jvp) from one definition:
//   ns::Name.overload(<arguments>) -> <returns>
//   ns::Name_fwd.overload(<arguments>, bool[]? needs_input_grad=None)
//       -> (<returns>, Tensor[] residuals)
//   ns::Name_bwd.overload(Tensor?[] saved, Tensor?[] grads,
//                         bool[] needs_input_grad, str state,
//                         SymInt[] state_ints) -> Tensor?[]
//   ns::Name_jvp.overload(<arguments>, Tensor?[] tangents)
//       -> (<returns>, Tensor[] tangents)      (only with a jvp kernel)
// (`_bwd` returns one gradient per forward argument; with differentiate_lists,
// one per element for a Tensor[] argument.)
// `ns::Name` gets the Autograd kernel (see autograd_kernel.cpp) and a
// CompositeExplicitAutograd kernel; `_fwd` and `_bwd` get the user's kernels.
// Fake (meta) kernels are registered by whoever supplies the kernels: the
// Python front end uses torch.library.register_fake.

#include <torch_opaque/forward_record.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/stack.h>

#include <torch/library.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch_opaque {

// A boxed kernel. It finds its arguments (as described by `schema`) on top of
// the stack, pops them and pushes its returns.
using BoxedKernel =
    std::function<void(const c10::FunctionSchema& schema, torch::jit::Stack* stack)>;

// The arguments of `ns::Name_bwd(Tensor?[] saved, Tensor?[] grads,
// bool[] needs_input_grad, str state, SymInt[] state_ints)`; undefined
// tensors stand for None.
struct BackwardArgs {
  std::vector<at::Tensor> saved;
  std::vector<at::Tensor> grads;
  std::vector<bool> needs_input_grad;
  std::string state;
  std::vector<c10::SymInt> state_ints;
};

// Note [Direct backward]
// A backward kernel as a plain function: it takes `_bwd`'s arguments and the
// eager state its node passed (Note [Eager context state]; nullptr when the
// state is in `args.state`), and returns `_bwd`'s result, one gradient per
// result slot (undefined for None). The backward node calls it without the
// dispatcher when a boxed `_bwd` call would reach it anyway: grad mode off,
// no forward gradients, no profiler (RecordFunction) callbacks, no Python
// dispatch mode, and the dispatch key the call would take (the tensors' keys
// with the thread's included keys, less the excluded and the autograd ones)
// a backend key that `_bwd` has no kernel of its own for, so that the
// CompositeExplicitAutograd kernel runs. That skips building c10::Lists and
// a stack, the dispatcher, and the boxed kernel's unpacking and packing
// (issues #11 and #16). Everything else (create_graph, torch.func levels,
// fake, functional or subclass tensors, dispatch modes, meta tensors with a
// fake kernel, the profiler) still calls `ns::Name_bwd` through the
// dispatcher, so traced graphs and profiles show it.
using DirectBackward =
    std::function<std::vector<at::Tensor>(BackwardArgs args, const EagerState* eager)>;

struct OpDefinition {
  std::string ns;        // e.g. "opaque"
  std::string name;      // e.g. "Foo"
  std::string overload;  // "" for the default overload
  std::string arguments; // e.g. "Tensor x, float alpha=1.0"
  std::vector<std::string> returns; // e.g. {"Tensor", "Tensor"}; at least one
  // Finds the arguments of `ns::Name` on the stack (the schema it is given is
  // `_fwd`'s, whose last argument, needs_input_grad, is passed through
  // take_needs_input_grad() instead); returns `returns` followed by Tensor[]
  // residuals. When take_needs_input_grad() gives flags, it must call
  // set_forward_record.
  BoxedKernel forward;
  // Arguments of `ns::Name_bwd`; returns one Tensor? per forward argument.
  // May be left empty when direct_backward is given: define_op derives it.
  BoxedKernel backward;
  // Optional: the same backward as a plain function (Note [Direct backward]),
  // which the backward node calls in eager mode.
  DirectBackward direct_backward;
  // Optional: a forward for meta tensors (same contract as `forward`),
  // registered on the Meta key of `ns::Name` and `ns::Name_fwd`. Without it
  // the CompositeExplicitAutograd kernels serve meta tensors too.
  BoxedKernel meta_forward;
  // Optional: forward-mode AD. Defines `ns::Name_jvp(<arguments>, Tensor?[]
  // tangents) -> (<returns>, Tensor[])` with this kernel (Note [C++ jvp] in
  // detail/jvp_finisher.h); without it, forward-mode AD raises torch's error.
  BoxedKernel jvp;
  // Register a FuncTorchBatched kernel that runs each op once per sample
  // (Note [Per-sample batching] in csrc/per_sample_batching.cpp), so vmap,
  // jacrev, jacfwd and vmap(grad(f)) work. The Python front end registers
  // rules of its own and leaves this false.
  bool per_sample_batching = false;
  // Optional, with per_sample_batching: a forward for a whole batch (same
  // contract as `forward`, every tensor argument and output with the batch as
  // its first dimension), run by `ns::Name` under vmap instead of one call
  // per sample (Note [Per-sample batching]).
  BoxedKernel batched_forward;
  // Tensor-list (Tensor[]) arguments: with false their elements are not
  // differentiated, as torch.autograd.Function does (the Python front end);
  // with true (the C++ API) each element is, as torch::autograd::Function
  // does, and `_bwd` returns one gradient per list element in the argument's
  // place (Note [Tensor-list gradients] in detail/finishers.h).
  bool differentiate_lists = false;
  // In-place ops (Note [In-place ops] in csrc/in_place.cpp): pairs (output k
  // of `_fwd`, Tensor argument i) whose result is written into argument i.
  // `ns::Name` then takes those arguments as `Tensor(a!)` and returns only the
  // other outputs; `_fwd` stays functional.
  std::vector<std::pair<size_t, size_t>> dirty;
};

class OpaqueOp;

// Registers the three operators. Throws c10::Error with a readable message
// when the definition is invalid (bad schema, name already taken, ...).
// Registrations live for the rest of the process.
std::shared_ptr<OpaqueOp> define_op(OpDefinition definition);

// Note [Static registration errors]
// TORCH_OPAQUE_DEF registers while a library is being loaded (static
// initialization), where an escaping exception ends the process through
// std::terminate. Its failures are recorded instead, and reported where they
// can be caught: torch_opaque.load_library raises them as a Python
// RegistrationError; a C++ program calls check_registrations() (e.g. first
// thing in main, or after dlopen) to get them as a c10::Error.
void record_registration_error(std::string message);
// The recorded failures, oldest first; the record is emptied.
std::vector<std::string> take_registration_errors();
// Throws c10::Error listing the recorded failures (and empties the record);
// does nothing when there are none.
void check_registrations();

// Undoes define_op for an op nothing will run again (the Python front end
// calls it when a wrapped Function class is garbage collected): drops the
// reference define_op keeps and, with it, the three registrations. `users` is
// the number of shared_ptrs the caller still holds itself; when there are
// more (autograd nodes of live tensors still use the op) nothing changes and
// false is returned, so the caller can try again later. Call it where the
// kernels may be destroyed (for Python kernels: with the GIL held).
bool release_op(const OpaqueOp& op, long users);

class OpaqueOp {
 public:
  const OpDefinition& definition() const { return def_; }
  // "ns::Name" / "ns::Name.overload" (made once: kernels pass it on every call)
  const std::string& qualified_name() const { return qualified_name_; }
  const c10::OperatorHandle& op() const { return op_; }
  const c10::OperatorHandle& forward_op() const { return fwd_op_; }
  const c10::OperatorHandle& backward_op() const { return bwd_op_; }
  size_t num_arguments() const { return num_args_; }
  size_t num_outputs() const { return def_.returns.size(); }

  // Internal: used by define_op.
  OpaqueOp(OpDefinition def, c10::OperatorHandle op, c10::OperatorHandle fwd,
           c10::OperatorHandle bwd);
  void keep_alive(std::unique_ptr<torch::Library> lib) { lib_ = std::move(lib); }
  // Internal: used by release_op.
  void drop_registrations() { lib_.reset(); }

 private:
  std::unique_ptr<torch::Library> lib_;
  OpDefinition def_;
  std::string qualified_name_;
  c10::OperatorHandle op_, fwd_op_, bwd_op_;
  size_t num_args_;
};

} // namespace torch_opaque
