// An op with a forward-mode derivative: torch.func.jvp, jacfwd and
// torch.autograd.forward_ad dual tensors use its `jvp` (Note [C++ jvp] in
// torch_opaque/detail/jvp_finisher.h).
#include <torch_opaque/op.h>

namespace {

// example::polar(Tensor r, Tensor theta) -> (Tensor x, Tensor y)
// x = r cos(theta), y = r sin(theta).
struct Polar {
  static constexpr const char* output_names[] = {"x", "y"};
  static std::tuple<at::Tensor, at::Tensor> forward(torch_opaque::Context& ctx,
                                                   const at::Tensor& r,
                                                   const at::Tensor& theta) {
    // Inputs rather than cos/sin: under hessian (jacfwd of jacrev) the
    // backward is differentiated in forward mode, where a saved intermediate
    // counts as a constant (as in a Python autograd.Function).
    ctx.save_for_backward({r, theta});  // what backward reads
    ctx.save_for_forward({r, theta});   // what jvp reads
    return {r * at::cos(theta), r * at::sin(theta)};
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& r = ctx.saved_tensors()[0];
    at::Tensor c = at::cos(ctx.saved_tensors()[1]), s = at::sin(ctx.saved_tensors()[1]);
    const at::Tensor &gx = grads[0], &gy = grads[1];
    return {gx * c + gy * s, (gy * c - gx * s) * r};
  }
  // One tangent per forward argument in (undefined where an argument has
  // none), one per output out.
  static std::vector<at::Tensor> jvp(torch_opaque::Context& ctx,
                                     std::vector<at::Tensor> tangents) {
    const at::Tensor& r = ctx.saved_tensors()[0];
    at::Tensor c = at::cos(ctx.saved_tensors()[1]), s = at::sin(ctx.saved_tensors()[1]);
    at::Tensor tx = at::zeros_like(r * c), ty = at::zeros_like(r * c);
    if (tangents[0].defined()) {
      tx = tx + tangents[0] * c;
      ty = ty + tangents[0] * s;
    }
    if (tangents[1].defined()) {
      tx = tx - r * s * tangents[1];
      ty = ty + r * c * tangents[1];
    }
    return {tx, ty};
  }
};

} // namespace

TORCH_OPAQUE_DEF(Polar, "example::polar", "r", "theta");
