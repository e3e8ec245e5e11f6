#pragma once
// The generic Autograd kernel of every opaque op, and its backward node.

#include <torch_opaque/opaque_op.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/boxing/KernelFunction.h>

#include <memory>

namespace torch_opaque::detail {

class AutogradKernel final : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(std::weak_ptr<OpaqueOp> op) : op_(std::move(op)) {}
  void operator()(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack);

 private:
  // The reverse-mode call: runs `_fwd` and records the backward node.
  void reverse(const std::shared_ptr<OpaqueOp>& op, const c10::OperatorHandle& handle,
               c10::DispatchKeySet keys, torch::jit::Stack* stack);
  // The op owns its registrations, which own this kernel: a weak pointer
  // avoids a reference cycle.
  std::weak_ptr<OpaqueOp> op_;
};

} // namespace torch_opaque::detail
