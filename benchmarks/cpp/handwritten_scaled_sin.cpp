// handwritten::scaled_sin(Tensor x, float scale) -> Tensor, the leanest
// correct way by hand: schemas, CompositeExplicitAutograd kernels (which also
// serve meta and fake tensors, so no Meta kernel is needed), an Autograd kernel
// around a torch::autograd::Function, and a separate backward op
// (handwritten::scaled_sin_backward) so the backward stays one node in
// compiled graphs. tests/test_cpp_ops.py checks that it passes opcheck, export
// and compile like the torch_opaque version.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor scaled_sin_op(const at::Tensor& x, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("handwritten::scaled_sin", "")
                       .typed<at::Tensor(const at::Tensor&, double)>();
  return op.call(x, scale);
}

at::Tensor scaled_sin_backward_op(const at::Tensor& grad, const at::Tensor& x, double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("handwritten::scaled_sin_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(grad, x, scale);
}

// Kernels (any device: made of ATen ops).
at::Tensor scaled_sin_kernel(const at::Tensor& x, double scale) {
  return at::sin(x) * scale;
}

at::Tensor scaled_sin_backward_kernel(const at::Tensor& grad, const at::Tensor& x,
                                      double scale) {
  return grad * at::cos(x) * scale;
}

// Autograd.
class ScaledSinFunction : public torch::autograd::Function<ScaledSinFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double scale) {
    ctx->save_for_backward({x});
    ctx->saved_data["scale"] = scale;
    at::AutoDispatchBelowADInplaceOrView guard;
    return scaled_sin_op(x, scale);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const double scale = ctx->saved_data["scale"].toDouble();
    return {scaled_sin_backward_op(grads[0], x, scale), at::Tensor()};
  }
};

at::Tensor scaled_sin_autograd(const at::Tensor& x, double scale) {
  return ScaledSinFunction::apply(x, scale);
}

} // namespace

TORCH_LIBRARY(handwritten, m) {
  m.def("scaled_sin(Tensor x, float scale) -> Tensor");
  m.def("scaled_sin_backward(Tensor grad, Tensor x, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(handwritten, CompositeExplicitAutograd, m) {
  m.impl("scaled_sin", scaled_sin_kernel);
  m.impl("scaled_sin_backward", scaled_sin_backward_kernel);
}

TORCH_LIBRARY_IMPL(handwritten, Autograd, m) {
  m.impl("scaled_sin", scaled_sin_autograd);
}
