// An op whose forward kernel is a loop over the elements instead of ATen ops:
// it runs and trains like any other, but cannot be traced to ATen, so it is
// not stored self-contained and has no ONNX function body (a `fake` gives
// torch.export its output shape).
#include <torch_opaque/op.h>

namespace {

// example::square_loop(Tensor x) -> Tensor: x * x, elementwise (float32).
struct SquareLoop {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "example::square_loop: x must be float32");
    ctx.save_for_backward({x});
    at::Tensor in = x.contiguous();
    at::Tensor out = at::empty_like(in);
    const float* src = in.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    for (int64_t i = 0; i < in.numel(); ++i) dst[i] = src[i] * src[i];
    return out;
  }
  static at::Tensor fake(torch_opaque::Context& ctx, const at::Tensor& x) {
    ctx.save_for_backward({x});
    return at::empty_like(x, at::MemoryFormat::Contiguous);
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    return {grads[0] * 2 * ctx.saved_tensors()[0]};
  }
};

} // namespace

TORCH_OPAQUE_DEF(SquareLoop, "example::square_loop", "x");
