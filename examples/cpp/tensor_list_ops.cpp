// Tensor lists: an op that takes one and differentiates each element, and an
// op that returns one.
#include <torch_opaque/op.h>

namespace {

// example::weighted_sum(Tensor[] xs, Tensor w) -> Tensor: sum_i w[i] * xs[i].
// The backward's slot for `xs` is a std::vector<at::Tensor>, one gradient per
// element (undefined where an element needs none).
struct WeightedSum {
  static at::Tensor forward(torch_opaque::Context& ctx, at::TensorList xs, const at::Tensor& w) {
    TORCH_CHECK(!xs.empty() && w.dim() == 1 && w.size(0) == static_cast<int64_t>(xs.size()),
                "weighted_sum: w must hold one weight per tensor of xs");
    at::Tensor out = xs[0] * w[0];
    for (size_t i = 1; i < xs.size(); ++i) out = out + xs[i] * w[i];
    std::vector<at::Tensor> saved(xs.begin(), xs.end());
    saved.push_back(w);
    ctx.save_for_backward(saved);
    return out;
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> grads) {
    const auto& saved = ctx.saved_tensors();
    const at::Tensor& w = saved.back();
    const size_t n = saved.size() - 1;
    std::vector<at::Tensor> gxs(n), gw(n);
    for (size_t i = 0; i < n; ++i) {
      if (ctx.needs_input_grad(0)) gxs[i] = grads[0] * w[i];
      gw[i] = (grads[0] * saved[i]).sum();
    }
    return {gxs, ctx.needs_input_grad(1) ? at::stack(gw) : at::Tensor()};
  }
};

// example::power_means(Tensor x, int[] orders=[1, 2]) -> Tensor[]: for each
// order k, the mean of x**k over the last dimension. Returning a
// std::vector<at::Tensor> gives one output per element (its length may depend
// on the arguments); the backward gets one gradient per element.
struct PowerMeans {
  static std::vector<at::Tensor> forward(torch_opaque::Context& ctx, const at::Tensor& x,
                                         at::IntArrayRef orders) {
    std::vector<at::Tensor> means;
    for (int64_t k : orders) means.push_back(x.pow(k).mean(-1));
    ctx.save_for_backward({x});
    ctx.saved_data["orders"] = orders.vec();
    return means;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& x = ctx.saved_tensors()[0];
    const auto orders = ctx.saved_data["orders"].toIntVector();
    at::Tensor gx = at::zeros_like(x);
    for (size_t i = 0; i < orders.size(); ++i) {
      const int64_t k = orders[i];
      if (k != 0) gx = gx + grads[i].unsqueeze(-1) * x.pow(k - 1) * k;
    }
    return {gx.div(at::Scalar(x.sym_size(-1))), at::Tensor()};
  }
};

} // namespace

TORCH_OPAQUE_DEF(WeightedSum, "example::weighted_sum", "xs", "w");
TORCH_OPAQUE_DEF(PowerMeans, "example::power_means", "x", "orders=[1, 2]");
