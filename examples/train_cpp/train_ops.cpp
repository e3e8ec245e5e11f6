// The layers of a small network, written with torch_opaque's C++ API: each op
// has its own backward, which a training step exported with
// torch_opaque.export_training keeps as a `Name_bwd` call.
//   train::linear(Tensor x, Tensor weight, Tensor bias) -> Tensor
//   train::tanh(Tensor x) -> Tensor
//   train::mse(Tensor prediction, Tensor target) -> Tensor   (a scalar)
#include <torch_opaque/op.h>

namespace {

// x @ weight^T + bias, as torch.nn.functional.linear.
struct Linear {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& bias) {
    ctx.save_for_backward({x, weight});
    return x.mm(weight.t()) + bias;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& x = ctx.saved_tensors()[0];
    const at::Tensor& weight = ctx.saved_tensors()[1];
    const at::Tensor& g = grads[0];
    return {ctx.needs_input_grad(0) ? g.mm(weight) : at::Tensor(),
            ctx.needs_input_grad(1) ? g.t().mm(x) : at::Tensor(),
            ctx.needs_input_grad(2) ? g.sum(0) : at::Tensor()};
  }
};

// tanh, its derivative written with the saved output.
struct Tanh {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x) {
    at::Tensor y = at::tanh(x);
    ctx.save_for_backward({y});
    return y;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& y = ctx.saved_tensors()[0];
    return {grads[0] * (1 - y * y)};
  }
};

// mean((prediction - target)^2); the target gets a gradient only when it
// needs one.
struct Mse {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& prediction,
                            const at::Tensor& target) {
    at::Tensor diff = prediction - target;
    ctx.save_for_backward({diff});
    return diff.pow(2).mean();
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& diff = ctx.saved_tensors()[0];
    // sym_numel: the batch size may be symbolic when the step is exported.
    at::Tensor g = (grads[0] * 2 * diff).div(c10::Scalar(diff.sym_numel()));
    return {g, ctx.needs_input_grad(1) ? -g : at::Tensor()};
  }
};

} // namespace

TORCH_OPAQUE_DEF(Linear, "train::linear", "x", "weight", "bias");
TORCH_OPAQUE_DEF(Tanh, "train::tanh", "x");
TORCH_OPAQUE_DEF(Mse, "train::mse", "prediction", "target");
