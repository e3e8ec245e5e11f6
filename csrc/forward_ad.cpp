#include "forward_ad.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

namespace torch_opaque::detail {

bool has_forward_grads(const torch::jit::Stack& stack, size_t n_args) {
  for (const c10::IValue& v : torch::jit::last(stack, n_args)) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && t._fw_grad(/*level=*/0).defined()) return true;
    }
  }
  return false;
}

void run_with_forward_grads(const OpaqueOp& op, torch::jit::Stack* stack,
                            const std::function<void(torch::jit::Stack*)>& reverse,
                            size_t n_extra) {
  const auto& def = op.definition();
  auto jvp = c10::Dispatcher::singleton().findSchema(
      {def.ns + "::" + def.name + "_jvp", def.overload});
  // The text of torch.autograd.Function.jvp, raised as stock does.
  TORCH_CHECK_NOT_IMPLEMENTED(jvp.has_value(),
                              "You must implement the jvp function for custom "
                              "autograd.Function to use it with forward mode AD.");
  const size_t n_args = op.num_arguments();
  const size_t n_out = op.num_outputs();
  std::vector<c10::IValue> args(stack->end() - n_args, stack->end());
  c10::List<std::optional<at::Tensor>> tangents;
  bool reverse_needed = n_extra > 0;
  for (const c10::IValue& v : args) {
    std::optional<at::Tensor> tangent;
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor& t = v.toTensor();
      at::Tensor g = t._fw_grad(/*level=*/0);
      if (g.defined()) tangent = g;
      reverse_needed = reverse_needed || (at::GradMode::is_enabled() && t.requires_grad());
    }
    tangents.push_back(std::move(tangent));
  }

  torch::jit::Stack jvp_stack;
  if (reverse_needed) {
    reverse(stack);  // the outputs, with the backward recorded
    jvp_stack.assign(args.begin(), args.end());
  } else {
    torch::jit::drop(*stack, n_args);
    jvp_stack = std::move(args);
  }
  jvp_stack.emplace_back(std::move(tangents));
  {
    at::AutoDispatchBelowADInplaceOrView below;
    jvp->callBoxed(jvp_stack);
  }
  TORCH_INTERNAL_ASSERT(jvp_stack.size() == n_out + 1);
  std::vector<at::Tensor> out_tangents = jvp_stack.back().toTensorList().vec();
  jvp_stack.pop_back();
  if (!reverse_needed) {
    for (auto& v : jvp_stack) stack->push_back(std::move(v));
  }
  auto outs = torch::jit::last(*stack, n_out + n_extra);
  for (size_t k = 0; k < n_out; ++k) {
    const at::Tensor& out = outs[k].toTensor();
    const at::Tensor& tangent = out_tangents.at(k);
    TORCH_CHECK(tangent.sizes() == out.sizes() || !out.defined(), op.qualified_name(),
                ": jvp returned a tangent of shape ", tangent.sizes(), " for output ", k,
                " of shape ", out.sizes(), ". Return tangents shaped like the outputs.");
    if (out.defined() && tangent.defined() && out.is_floating_point()) {
      out._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
    }
  }
}

} // namespace torch_opaque::detail
