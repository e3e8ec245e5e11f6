#pragma once
// What runs after a user's forward or backward, for C++ ops and Python
// Functions alike: turning a finished Context (or a Python forward's outcome)
// into outputs, residuals and a forward record, and a `_bwd` call back into a
// Context. Compiled once in csrc/finishers.cpp.

#include <torch_opaque/context.h>
#include <torch_opaque/forward_record.h>
#include <torch_opaque/gradient.h>
#include <torch_opaque/opaque_op.h>

#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_opaque::detail {

// What a forward produced, in whatever language it ran: its outputs and,
// when the call is recorded, what its ctx holds.
struct ForwardOutcome {
  std::vector<at::Tensor> outputs;
  bool list_output = false;  // the outputs are the elements of one Tensor[] return
  std::vector<at::Tensor> saved;  // save_for_backward order; undefined = None
  std::vector<at::Tensor> non_differentiable;
  bool materialize_grads = true;
  std::string state;  // Note [saved_data encoding], or Python's (context.py)
  std::vector<c10::SymInt> state_ints;
  std::shared_ptr<const EagerState> eager_state;  // Note [Eager context state]
};

// Note [One forward finisher]
// After the user's forward, for C++ ops and Python Functions alike: pushes
// the outputs (copies of those that alias an input or another output) and the
// residual list; when `recording`, matches each saved tensor to an input, an
// output or a new residual (copied when it aliases either) and reports the
// forward record. `inputs` are the `_fwd` arguments without needs_input_grad.
void finish_forward(const std::string& op_name, c10::ArrayRef<c10::IValue> inputs,
                    ForwardOutcome outcome, bool recording, torch::jit::Stack* stack);

// The same for a C++ Context (saved_data kept for eager backwards, encoded per
// Note [saved_data encoding] when the backward is traced).
// With `list_output`, `outputs` are pushed as one Tensor[] (saved outputs and
// non-differentiable flags then refer to its elements).
void finish_forward(const std::string& op_name, Context& ctx,
                    c10::ArrayRef<c10::IValue> inputs,
                    std::vector<at::Tensor> outputs, bool recording,
                    torch::jit::Stack* stack, bool list_output = false);

// Pops the `_bwd` arguments (BackwardArgs, opaque_op.h).
BackwardArgs pop_backward_args(torch::jit::Stack* stack);

// The boxed `_bwd` kernel of a DirectBackward (Note [Direct backward]): pops
// the arguments, calls it with the eager state the node passed for `schema`'s
// op, pushes the result as one Tensor?[].
BoxedKernel boxed_backward(DirectBackward direct);

// The Context (saved tensors, saved_data, needs_input_grad) of a backward
// call; `args.saved` and `args.needs_input_grad` are moved into it.
// saved_data is the forward's own map when the node passed it (`eager`: Note
// [Eager context state]), else decoded from `args.state`.
Context backward_context(BackwardArgs& args, const EagerState* eager);

// The gradients as the `_bwd` result, after checking them against the
// forward arguments (`tensor_args[i]`: whether argument i is a tensor);
// gradients that alias a saved tensor, an output gradient or an earlier
// gradient are copied.
//
// Note [Backward results do not alias]
// `_bwd` is an operator, so its results may share storage neither with its
// arguments nor with each other (torch's custom-op contract). A backward often
// returns one tensor for several arguments (`return g, g` in Python; the same
// gradient for several elements of a Tensor[] in C++; views of one tensor, as
// g.unbind(0)). Without a copy, tracing records all the slots holding one
// tensor as one output of the `_bwd` node (the last: the tracer keys its
// proxies by tensor), and Inductor's code treats each output as a buffer of
// its own: a compiled backward traced while the outputs were separate (served
// from Inductor's cache) gave wrong gradients when they came back as one
// tensor. Each gradient sharing storage with an earlier one is therefore
// cloned, as finish_forward clones an output that aliases an input or an
// earlier output.
std::vector<at::Tensor> finish_backward(const std::string& op_name,
                                        const std::vector<bool>& tensor_args,
                                        std::vector<at::Tensor> grads,
                                        c10::ArrayRef<at::Tensor> saved,
                                        c10::ArrayRef<at::Tensor> grad_outputs);

// Note [Tensor-list gradients]
// A C++ op differentiates the elements of its Tensor[] arguments (as
// torch::autograd::Function does): `_bwd` then returns one slot per
// argument, except that a Tensor[] argument has one slot per element. The
// forward records the list lengths in the backward's state (record_list_sizes,
// under a key of its own) so that `_bwd` knows the layout; the backward's
// Gradient entries are flattened into those slots (flatten_gradients).
void record_list_sizes(Context& ctx, c10::ArrayRef<c10::IValue> inputs);
// The lengths record_list_sizes stored, removed from ctx.saved_data (empty
// when there were none).
std::vector<int64_t> take_list_sizes(Context& ctx);
// One gradient per `_bwd` slot; `tensor_args` (one flag per argument) becomes
// one flag per slot. `list_args[i]`: whether argument i is a Tensor[].
std::vector<at::Tensor> flatten_gradients(const std::string& op_name,
                                          const std::vector<bool>& list_args,
                                          const std::vector<int64_t>& list_sizes,
                                          std::vector<Gradient> grads,
                                          std::vector<bool>* tensor_args);

} // namespace torch_opaque::detail
