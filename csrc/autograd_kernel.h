#pragma once
// The generic Autograd kernel of every opaque op, and its backward node.

#include <torch_opaque/opaque_op.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/boxing/KernelFunction.h>

#include <memory>

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

} // namespace torch_opaque::detail
