// Two differentiable, exportable operators written with torch_opaque.
// The first is quoted verbatim by the README (tests/test_docs.py checks it).
#include <torch_opaque/op.h>

struct ScaledSin {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, double scale) {
    ctx.save_for_backward({x});
    ctx.saved_data["scale"] = scale;
    return at::sin(x) * scale;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& x = ctx.saved_tensors()[0];
    return {grads[0] * at::cos(x) * ctx.saved_data["scale"].toDouble(), at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(ScaledSin, "example::scaled_sin", "x", "scale");
// -> example::scaled_sin(Tensor x, float scale) -> Tensor

namespace {

// example::top_value(Tensor x, int dim=-1) -> (Tensor values, Tensor indices)
// The indices are not differentiable.
struct TopValue {
  static constexpr const char* output_names[] = {"values", "indices"};
  static std::tuple<at::Tensor, at::Tensor> forward(torch_opaque::Context& ctx,
                                                   const at::Tensor& x, int64_t dim) {
    auto [values, indices] = x.max(dim);
    ctx.mark_non_differentiable({indices});
    ctx.save_for_backward({indices});
    ctx.saved_data["dim"] = dim;
    ctx.saved_data["sizes"] = x.sym_sizes().vec();
    return {values, indices};
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& indices = ctx.saved_tensors()[0];
    const int64_t dim = ctx.saved_data["dim"].toInt();
    auto sizes = ctx.saved_data["sizes"].toSymIntVector();
    at::Tensor gx = at::zeros_symint(sizes, grads[0].options())
                        .scatter(dim, indices.unsqueeze(dim), grads[0].unsqueeze(dim));
    return {gx, at::Tensor()};
  }
};

} // namespace

TORCH_OPAQUE_DEF(TopValue, "example::top_value", "x", "dim=-1");
