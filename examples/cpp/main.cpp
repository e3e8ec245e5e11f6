// Uses the example ops from C++ only: forward, backward, printed results.
// Exits non-zero when a result differs from the closed-form expectation.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/torch.h>

#include <iostream>

namespace {
std::vector<at::Tensor> call(const char* name, std::vector<c10::IValue> args) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack(args.begin(), args.end());
  op.callBoxed(stack);
  std::vector<at::Tensor> out;
  for (auto& v : stack) out.push_back(v.toTensor());
  return out;
}
} // namespace

int main() {
  torch::manual_seed(0);
  bool ok = true;

  auto x = torch::randn({2, 3}, torch::kDouble).requires_grad_();
  auto y = call("example::scaled_sin", {x, 2.0})[0];
  y.sum().backward();
  std::cout << "scaled_sin(x, 2.0) =\n" << y << "\ngrad =\n" << x.grad() << "\n";
  ok &= torch::allclose(y, x.detach().sin() * 2) &&
        torch::allclose(x.grad(), x.detach().cos() * 2);

  auto z = torch::randn({2, 4}, torch::kDouble).requires_grad_();
  auto outs = call("example::top_value", {z, int64_t(1)});
  (outs[0] * 3).sum().backward();
  std::cout << "top_value(z, 1) values = " << outs[0] << "\nindices = " << outs[1]
            << "\ngrad =\n" << z.grad() << "\n";
  auto expected = torch::zeros_like(z).scatter(1, outs[1].unsqueeze(1), 3.0);
  ok &= !outs[1].requires_grad() && torch::allclose(z.grad(), expected);

  // Forward-mode AD (the op's jvp): dual tensors at level 0, as
  // torch.autograd.forward_ad.dual_level() makes them.
  {
    const uint64_t level = torch::autograd::ForwardADLevel::get_next_idx();
    auto r = torch::rand({3}, torch::kDouble), theta = torch::randn({3}, torch::kDouble);
    auto dtheta = torch::ones_like(theta);
    auto xy = call("example::polar", {r, at::_make_dual(theta, dtheta, level)});
    auto dx = std::get<1>(at::_unpack_dual(xy[0], level));
    std::cout << "d/dtheta of polar(r, theta).x = " << dx << "\n";
    ok &= dx.defined() && torch::allclose(dx, -r * theta.sin());
    torch::autograd::ForwardADLevel::release_idx(level);
  }

  std::cout << (ok ? "example ops: OK" : "example ops: MISMATCH") << std::endl;
  return ok ? 0 : 1;
}
