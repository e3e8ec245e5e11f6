// Loaded by tests/test_cpp_transforms.py: C++ ops for the error cases of
// vmap and forward-mode AD (Note [Per-sample batching], Note [C++ jvp]).
#include <torch_opaque/op.h>

namespace {

// x * max(x), with max(x) kept in saved_data: a different value per sample,
// which one backward node cannot hold under vmap(grad(f)).
struct ScaleByMax {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x) {
    const double m = x.max().item<double>();
    ctx.saved_data["m"] = m;
    return x * m;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    return {grads[0] * ctx.saved_data["m"].toDouble()};  // max(x) taken as a constant
  }
};

// A jvp that returns a tangent of the wrong shape.
struct WrongTangentShape {
  static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) { return x * 2; }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor> g) {
    return {g[0] * 2};
  }
  static std::vector<at::Tensor> jvp(torch_opaque::Context&, std::vector<at::Tensor> t) {
    return {t[0].sum()};
  }
};

// cumsum over the last dimension, times scale, with a batched forward: under
// vmap `cumsum_scaled` runs once for the whole batch.
struct CumsumScaled {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, double scale) {
    ctx.saved_data["scale"] = scale;
    return x.cumsum(-1) * scale;
  }
  // The batch comes first; the last dimension is still the one to sum.
  static at::Tensor batched_forward(torch_opaque::Context& ctx, const at::Tensor& x,
                                    double scale) {
    return forward(ctx, x, scale);
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    at::Tensor g = grads[0].flip(-1).cumsum(-1).flip(-1);
    return {g * ctx.saved_data["scale"].toDouble(), at::Tensor()};
  }
};

// A batched forward that drops the batch dimension.
struct BadBatched {
  static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) { return x * 2; }
  static at::Tensor batched_forward(torch_opaque::Context&, const at::Tensor& x) {
    return x.flatten() * 2;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor> g) {
    return {g[0] * 2};
  }
};

} // namespace

TORCH_OPAQUE_DEF(CumsumScaled, "opaque_transform_test::cumsum_scaled", "x", "scale");
TORCH_OPAQUE_DEF(BadBatched, "opaque_transform_test::bad_batched", "x");
TORCH_OPAQUE_DEF(ScaleByMax, "opaque_transform_test::scale_by_max", "x");
TORCH_OPAQUE_DEF(WrongTangentShape, "opaque_transform_test::wrong_tangent_shape", "x");
