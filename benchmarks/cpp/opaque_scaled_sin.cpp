// opaque_bench::scaled_sin(Tensor x, float scale) -> Tensor, written with
// torch_opaque (the same op as examples/cpp/example_ops.cpp's ScaledSin).
#include <torch_opaque/op.h>

#include <ATen/ATen.h>

namespace {

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

} // namespace

TORCH_OPAQUE_DEF(ScaledSin, "opaque_bench::scaled_sin", "x", "scale");
