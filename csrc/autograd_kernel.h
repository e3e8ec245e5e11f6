#pragma once
// The generic Autograd kernel of every opaque op, and its backward node.

#include <torch_opaque/opaque_op.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/boxing/KernelFunction.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

namespace torch_opaque::detail {

// Registered for `ns::Name` and, with `forward_op` true, for `ns::Name_fwd`
// (whose trailing needs_input_grad argument it replaces by the flags of the
// tensors that require grad, and whose residuals it returns undifferentiated):
// a graph that calls `_fwd` with inputs requiring grad trains with the
// Function's backward.
class AutogradKernel final : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(std::weak_ptr<OpaqueOp> op, bool forward_op = false)
      : op_(std::move(op)), forward_op_(forward_op) {}
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);

 private:
  // The reverse-mode call: runs `_fwd` and records the backward node.
  void reverse(const std::shared_ptr<OpaqueOp>& op, const c10::OperatorHandle& handle,
               c10::DispatchKeySet keys, torch::jit::Stack* stack);
  // The op owns its registrations, which own this kernel: a weak pointer
  // avoids a reference cycle.
  std::weak_ptr<OpaqueOp> op_;
  bool forward_op_;
};

// The Autograd kernel of `ns::Name_bwd` (Note [Double backward] in
// csrc/backward_autograd_kernel.cpp).
class BackwardAutogradKernel final : public c10::OperatorKernel {
 public:
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);
};

// Note [Backward node introspection]
// A stock Function's grad_fn is its ctx: code reads `y.grad_fn.saved_tensors`,
// the attributes forward set (`y.grad_fn.scale`), `needs_input_grad` and
// `_forward_cls`. The op's backward node (OpaqueBackward) keeps all of it;
// this is what the Python type of the node (csrc/python/backward_node_type.cpp)
// reads. Saved tensors are unpacked as backward unpacks them, so a freed graph
// raises torch's own error.
struct OpaqueNodeState {
  const OpDefinition* definition;  // the op's (alive while the node is)
  std::vector<bool> needs_input_grad;
  std::vector<at::Tensor> saved;  // (with_saved only)
  std::string state;  // encoded ctx attributes, when there is no eager state
  std::vector<c10::SymInt> state_ints;
  const EagerState* eager_state;  // the ctx attributes as objects, or nullptr
};

// The C++ type of the backward node of every op call.
const std::type_info& opaque_backward_type();

// What `node` (of opaque_backward_type()) holds; `saved` stays empty unless
// `with_saved` (then a node whose saved tensors were freed raises).
OpaqueNodeState opaque_node_state(torch::autograd::Node& node, bool with_saved);

// Note [Raw saved tensors]
// A stock node's `_raw_saved_tensors` gives its SavedVariables themselves
// (torch._C._autograd.SavedTensor), so code can `register_hooks(pack,
// unpack)` on one saved tensor after the forward ran: the pack hook runs at
// once, the unpack hook whenever the tensor is unpacked (the backward, or
// `saved_tensors`). The op's backward node saves its tensors as
// SavedVariables (Note [Opaque backward node]), so these are the same
// objects, with the same checks (hooks set twice, a None saved). A node whose
// saved tensors were freed by a backward pass refuses with torch's message.
std::vector<torch::autograd::SavedVariable>& opaque_node_saved_variables(
    torch::autograd::Node& node);

} // namespace torch_opaque::detail
