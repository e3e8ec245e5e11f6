// Loaded by tests/test_cpp_autocast.py: C++ ops whose forwards autocast
// (at::matmul), for Note [Autocast in the call: C++ ops] in
// csrc/autocast_variant.cpp. The backwards are the Python test's MatMul's
// (tests/impl/test_autocast_in_the_call.py), written with ATen ops.
#include <torch_opaque/op.h>

namespace {

std::vector<at::Tensor> matmul_backward(const at::Tensor& x, const at::Tensor& w,
                                        const at::Tensor& g) {
  return {at::matmul(g, w.t().to(g.scalar_type())),
          at::matmul(x.t().to(g.scalar_type()), g).to(w.scalar_type())};
}

struct Matmul {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx.save_for_backward({x, w});
    return at::matmul(x, w);
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const auto& saved = ctx.saved_tensors();
    return matmul_backward(saved[0], saved[1], grads[0]);
  }
};

// The same with a float argument, a fake (a Meta kernel of its own; made of
// ATen ops, it computes autocast's dtype under the variant's state too) and a
// jvp (forward-mode AD).
struct ScaledMatmul {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, const at::Tensor& w,
                            double scale) {
    ctx.save_for_backward({x, w});
    ctx.save_for_forward({x, w});
    ctx.saved_data["scale"] = scale;
    return at::matmul(x, w) * scale;
  }
  static at::Tensor fake(torch_opaque::Context& ctx, const at::Tensor& x, const at::Tensor& w,
                         double scale) {
    return forward(ctx, x, w, scale);  // saves what forward saves
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const auto& saved = ctx.saved_tensors();
    auto g = matmul_backward(saved[0], saved[1], grads[0] * ctx.saved_data["scale"].toDouble());
    g.emplace_back();  // scale
    return g;
  }
  static std::vector<at::Tensor> jvp(torch_opaque::Context& ctx, std::vector<at::Tensor> t) {
    const auto& s = ctx.saved_tensors();
    at::Tensor out = at::zeros_like(at::matmul(s[0], s[1]));
    if (t[0].defined()) out = out + at::matmul(t[0], s[1]);
    if (t[1].defined()) out = out + at::matmul(s[0], t[1]);
    return {out * ctx.saved_data["scale"].toDouble()};
  }
};

} // namespace

TORCH_OPAQUE_DEF(Matmul, "opaque_autocast_test::matmul", "x", "w");
TORCH_OPAQUE_DEF(ScaledMatmul, "opaque_autocast_test::scaled_matmul", "x", "w", "scale");
