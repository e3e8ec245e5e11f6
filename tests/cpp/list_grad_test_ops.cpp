// Loaded by tests/test_cpp_list_ops_compiled.py: Tensor[] ops written the way
// users write them (const std::vector<at::Tensor>&, a forward that starts from
// at::zeros_like, a backward that returns std::vector<Gradient>), whose list
// gradients must reach every element under torch.compile with each backend
// (Note [Tensor-list gradients] in include/torch_opaque/detail/finishers.h).
#include <torch_opaque/op.h>

namespace {

// opaque_list_compile_test::weighted_sum(Tensor[] xs, Tensor w) -> Tensor:
// sum_i xs[i] * w[i].
struct WeightedSum {
  static at::Tensor forward(torch_opaque::Context& ctx, const std::vector<at::Tensor>& xs,
                            const at::Tensor& w) {
    TORCH_CHECK(!xs.empty() && w.dim() == 1 && w.size(0) == static_cast<int64_t>(xs.size()),
                "weighted_sum: w must hold one weight per tensor of xs");
    at::Tensor out = at::zeros_like(xs[0]);
    for (size_t i = 0; i < xs.size(); ++i) out = out + xs[i] * w[i];
    std::vector<at::Tensor> saved(xs.begin(), xs.end());
    saved.push_back(w);
    ctx.save_for_backward(saved);
    return out;
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> grads) {
    std::vector<at::Tensor> saved = ctx.saved_tensors();
    const at::Tensor w = saved.back();
    saved.pop_back();
    std::vector<at::Tensor> gxs, gw;
    for (size_t i = 0; i < saved.size(); ++i) {
      gxs.push_back(grads[0] * w[i]);
      gw.push_back((grads[0] * saved[i]).sum());
    }
    std::vector<torch_opaque::Gradient> out;
    out.emplace_back(gxs);
    out.emplace_back(at::stack(gw));
    return out;
  }
};

// opaque_list_compile_test::scaled_sum(Tensor[] xs, Tensor s) -> Tensor:
// s * sum_i xs[i], s a one-element tensor. The backward returns one tensor
// for every element (Note [Backward results do not alias]).
struct ScaledSum {
  static at::Tensor forward(torch_opaque::Context& ctx, const std::vector<at::Tensor>& xs,
                            const at::Tensor& s) {
    at::Tensor total = at::zeros_like(xs[0]);
    for (const at::Tensor& x : xs) total = total + x;
    ctx.save_for_backward({total, s});
    ctx.saved_data["n"] = static_cast<int64_t>(xs.size());
    return total * s;
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> grads) {
    const at::Tensor& total = ctx.saved_tensors()[0];
    const at::Tensor& s = ctx.saved_tensors()[1];
    const at::Tensor g = grads[0] * s;
    const auto n = static_cast<size_t>(ctx.saved_data["n"].toInt());
    return {std::vector<at::Tensor>(n, g), (grads[0] * total).sum().reshape(s.sizes())};
  }
};

// opaque_list_compile_test::stacked_weighted_sum: weighted_sum whose backward
// computes every element's gradient at once and returns views of that one
// tensor (g.unbind(0)).
struct StackedWeightedSum {
  static at::Tensor forward(torch_opaque::Context& ctx, const std::vector<at::Tensor>& xs,
                            const at::Tensor& w) {
    at::Tensor stacked = at::stack(xs);
    std::vector<int64_t> shape(stacked.dim(), 1);
    shape[0] = w.size(0);
    ctx.save_for_backward({stacked, w});
    return (stacked * w.reshape(shape)).sum(0);
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> grads) {
    const at::Tensor& stacked = ctx.saved_tensors()[0];
    const at::Tensor& w = ctx.saved_tensors()[1];
    std::vector<int64_t> shape(stacked.dim(), 1);
    shape[0] = w.size(0);
    const at::Tensor g = grads[0].unsqueeze(0) * w.reshape(shape);
    std::vector<at::Tensor> parts = g.unbind(0);
    return {parts, (stacked * grads[0].unsqueeze(0)).flatten(1).sum(1)};
  }
};

} // namespace

TORCH_OPAQUE_DEF(WeightedSum, "opaque_list_compile_test::weighted_sum", "xs", "w");
TORCH_OPAQUE_DEF(ScaledSum, "opaque_list_compile_test::scaled_sum", "xs", "s");
TORCH_OPAQUE_DEF(StackedWeightedSum, "opaque_list_compile_test::stacked_weighted_sum", "xs", "w");
