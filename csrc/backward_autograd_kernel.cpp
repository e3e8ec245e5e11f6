#include "autograd_kernel.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <string>

namespace torch_opaque::detail {
namespace {

// Whether autograd records through `v`: a tensor that requires grad (grad
// mode on), or one carrying a forward gradient (torch.func.jvp, jacfwd, dual
// tensors: the backward's operations propagate its tangent).
bool any_differentiable(const c10::IValue& v, bool grad_on) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() &&
        ((grad_on && t.requires_grad()) || t._fw_grad(/*level=*/0).defined());
  }
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (any_differentiable(e, grad_on)) return true;
    }
  }
  return false;
}

} // namespace

// Note [Double backward]
// `ns::Name_bwd` runs the user's backward. When autograd would record it
// (grad mode on, as under create_graph=True, and a saved tensor or an output
// gradient requires grad), the kernel runs above autograd: the operations the
// backward is written with record their own derivatives, exactly as the
// backward of a stock autograd.Function does, so its gradients can be
// differentiated again (Python backwards, and C++ backwards written with ATen
// operations). A `once_differentiable` backward raises torch's own error when
// differentiated twice. Otherwise (first-order backward, traced training
// graphs) `_bwd` runs below autograd and stays one node.
void BackwardAutogradKernel::operator()(const c10::OperatorHandle& handle,
                                        c10::DispatchKeySet keys,
                                        torch::jit::Stack* stack) {
  bool record = false;
  const bool grad_on = at::GradMode::is_enabled();
  const size_t n = handle.schema().arguments().size();
  for (const c10::IValue& v : torch::jit::last(*stack, n)) {
    if (any_differentiable(v, grad_on)) {
      record = true;
      break;
    }
  }
  if (record) {
    // Under torch.func transforms the arguments are grad wrappers of the
    // current level: the user's backward runs on them (the functorch keys
    // left out), so each of its operations records at this level and, going
    // down the transform stack, at every outer level (Note [Nested grad]).
    // Redispatching through FuncTorchDynamicLayerBackMode would unwrap them
    // first and record nothing: grad(grad(f)) would be zero. (The backward
    // node calls the kernel directly when it can: Note [Nested grad].)
    constexpr c10::DispatchKeySet functorch_keys({c10::DispatchKey::FuncTorchDynamicLayerBackMode,
                                                  c10::DispatchKey::FuncTorchGradWrapper});
    const c10::DispatchKeySet to_kernel = (keys & c10::after_ADInplaceOrView_keyset) - functorch_keys;
    if (!keys.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode)) {
      handle.redispatchBoxed(to_kernel, stack);
      return;
    }
    try {
      handle.redispatchBoxed(to_kernel, stack);
    } catch (const std::exception& e) {
      // Inside a level functorch's own entry key is off: a stock Function
      // the backward calls cannot find its transform rules.
      const std::string what = e.what();
      if (what.find("HigherOrderOperator custom_function_call") == std::string::npos) throw;
      TORCH_CHECK_NOT_IMPLEMENTED(
          false, "torch_opaque: ", handle.schema().name(),
          ": the backward calls a stock autograd.Function, which is not supported yet where "
          "torch.func calls this backward op inside the processing of a transform level. "
          "Wrap that Function with torch_opaque.op too, or compute the derivative with "
          "torch.autograd.grad(create_graph=True). The error was: ", what);
    }
    return;
  }
  at::AutoDispatchBelowADInplaceOrView below;
  handle.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

} // namespace torch_opaque::detail
