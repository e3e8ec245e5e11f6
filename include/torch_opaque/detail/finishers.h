#pragma once
// What runs after a user's forward or backward, for C++ ops and Python
// Functions alike: turning a finished Context (or a Python forward's outcome)
// into outputs, residuals and a forward record, and a `_bwd` call back into a
// Context. Compiled once in csrc/finishers.cpp.

#include <torch_opaque/context.h>
#include <torch_opaque/forward_record.h>

#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_opaque::detail {

// What a forward produced, in whatever language it ran: its outputs and,
// when the call is recorded, what its ctx holds.
struct ForwardOutcome {
  std::vector<at::Tensor> outputs;
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

// The same for a C++ Context (saved_data encoded per Note [saved_data encoding]).
void finish_forward(const std::string& op_name, Context& ctx,
                    c10::ArrayRef<c10::IValue> inputs,
                    std::vector<at::Tensor> outputs, bool recording,
                    torch::jit::Stack* stack);

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
BackwardArgs pop_backward_args(torch::jit::Stack* stack);

// Pops the `_bwd` arguments; returns the Context (saved tensors, saved_data,
// needs_input_grad) and the output gradients.
std::pair<Context, std::vector<at::Tensor>> start_backward(torch::jit::Stack* stack);

// Pushes the gradients as the `_bwd` result after checking them against the
// forward arguments (`tensor_args[i]`: whether argument i is a tensor);
// gradients that alias a saved tensor or an output gradient are copied.
void finish_backward(const std::string& op_name, const std::vector<bool>& tensor_args,
                     std::vector<at::Tensor> grads, c10::ArrayRef<at::Tensor> saved,
                     c10::ArrayRef<at::Tensor> grad_outputs, torch::jit::Stack* stack);

} // namespace torch_opaque::detail
