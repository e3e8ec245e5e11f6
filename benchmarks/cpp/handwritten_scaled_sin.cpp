// handwritten::scaled_sin(Tensor x, float scale) -> Tensor, written the usual
// way: schema, CompositeExplicitAutograd kernel, Meta kernel, an Autograd
// kernel around a torch::autograd::Function, and a separate backward op
// (handwritten::scaled_sin_backward) so the backward stays one exportable node.
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

// Meta kernels: shape and dtype only (sin/cos promote integral inputs to the
// default float dtype).
at::ScalarType sin_dtype(const at::Tensor& x) {
  return at::isIntegralType(x.scalar_type(), /*includeBool=*/true)
      ? at::typeMetaToScalarType(at::get_default_dtype())
      : x.scalar_type();
}

at::Tensor scaled_sin_meta(const at::Tensor& x, double) {
  return at::empty_like(x, x.options().dtype(sin_dtype(x)));
}

at::Tensor scaled_sin_backward_meta(const at::Tensor& grad, const at::Tensor& x, double) {
  TORCH_CHECK(grad.sym_sizes() == x.sym_sizes(), "scaled_sin_backward: shape mismatch");
  return at::empty_like(grad, grad.options().dtype(
                                  at::promote_types(grad.scalar_type(), sin_dtype(x))));
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

TORCH_LIBRARY_IMPL(handwritten, Meta, m) {
  m.impl("scaled_sin", scaled_sin_meta);
  m.impl("scaled_sin_backward", scaled_sin_backward_meta);
}

TORCH_LIBRARY_IMPL(handwritten, Autograd, m) {
  m.impl("scaled_sin", scaled_sin_autograd);
}
