// An op whose output size depends on the data: its `fake` says so with
// ctx.new_dynamic_size() (Note [Data-dependent sizes] in
// torch_opaque/fake_checks.h).
#include <torch_opaque/op.h>

namespace {

// example::threshold_select(Tensor x, float threshold) -> Tensor: the elements
// of x above threshold, as a 1-D tensor (like masked_select).
struct ThresholdSelect {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, double threshold) {
    at::Tensor mask = x > threshold;
    ctx.save_for_backward({mask});
    return x.masked_select(mask);
  }
  // Without data, the number of selected elements is unknown: a new dynamic
  // size (at most x.numel(), which may itself be symbolic, so not given).
  static at::Tensor fake(torch_opaque::Context& ctx, const at::Tensor& x, double threshold) {
    ctx.save_for_backward({at::empty_like(x, x.options().dtype(at::kBool))});
    return at::empty_symint({ctx.new_dynamic_size()}, x.options());
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& mask = ctx.saved_tensors()[0];
    return {at::zeros_like(mask, grads[0].options()).masked_scatter(mask, grads[0]),
            at::Tensor()};
  }
};

} // namespace

TORCH_OPAQUE_DEF(ThresholdSelect, "example::threshold_select", "x", "threshold");
