#include "autograd_kernel.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace torch_opaque::detail {
namespace {

bool any_requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && v.toTensor().requires_grad();
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (any_requires_grad(e)) return true;
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
  if (at::GradMode::is_enabled()) {
    const size_t n = handle.schema().arguments().size();
    for (const c10::IValue& v : torch::jit::last(*stack, n)) {
      if (any_requires_grad(v)) {
        record = true;
        break;
      }
    }
  }
  if (record) {
    handle.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    return;
  }
  at::AutoDispatchBelowADInplaceOrView below;
  handle.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

} // namespace torch_opaque::detail
