// GoogleTest suite: forward-mode AD of C++ ops (an op's jvp, Note [C++ jvp]),
// without Python. (vmap is tested from Python, tests/test_cpp_transforms.py:
// entering a vmap level from C++ needs functorch's DynamicLayer.h, which
// needs nlohmann/json, not shipped with torch.)
#include <torch_opaque/op.h>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/torch.h>

namespace {

// sin(x) * y with a jvp.
struct SinMul {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, const at::Tensor& y) {
    ctx.save_for_backward({x, y});
    ctx.save_for_forward({x, y});
    return at::sin(x) * y;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor &x = ctx.saved_tensors()[0], &y = ctx.saved_tensors()[1];
    return {grads[0] * at::cos(x) * y, grads[0] * at::sin(x)};
  }
  static std::vector<at::Tensor> jvp(torch_opaque::Context& ctx,
                                     std::vector<at::Tensor> tangents) {
    const at::Tensor &x = ctx.saved_tensors()[0], &y = ctx.saved_tensors()[1];
    at::Tensor t = at::zeros_like(x);
    if (tangents[0].defined()) t = t + tangents[0] * at::cos(x) * y;
    if (tangents[1].defined()) t = t + tangents[1] * at::sin(x);
    return {t};
  }
};
TORCH_OPAQUE_DEF(SinMul, "opaque_cpp_transforms::sin_mul", "x", "y");

// The same without jvp.
struct SinMulNoJvp {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, const at::Tensor& y) {
    return SinMul::forward(ctx, x, y);
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    return SinMul::backward(ctx, grads);
  }
};
TORCH_OPAQUE_DEF(SinMulNoJvp, "opaque_cpp_transforms::sin_mul_no_jvp", "x", "y");

// A jvp returning the wrong number of tangents.
struct BadJvp {
  static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) { return x * 2; }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor> g) {
    return {g[0] * 2};
  }
  static std::vector<at::Tensor> jvp(torch_opaque::Context&, std::vector<at::Tensor> t) {
    return {t[0] * 2, t[0]};
  }
};
TORCH_OPAQUE_DEF(BadJvp, "opaque_cpp_transforms::bad_jvp", "x");

at::Tensor call(const char* name, const at::Tensor& x, const at::Tensor& y) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  return op.typed<at::Tensor(const at::Tensor&, const at::Tensor&)>().call(x, y);
}

// Forward-mode AD at level 0, as torch.autograd.forward_ad.dual_level.
struct DualLevel {
  DualLevel() : idx(torch::autograd::ForwardADLevel::get_next_idx()) {}
  ~DualLevel() { torch::autograd::ForwardADLevel::release_idx(idx); }
  uint64_t idx;
};

TEST(CppTransforms, DualTensorsUseTheOpsJvp) {
  torch_opaque::check_registrations();
  at::Tensor x = at::randn({4}, at::kDouble), y = at::randn({4}, at::kDouble);
  at::Tensor tx = at::randn({4}, at::kDouble), ty = at::randn({4}, at::kDouble);
  DualLevel level;
  ASSERT_EQ(level.idx, 0u);
  at::Tensor out = call("opaque_cpp_transforms::sin_mul", at::_make_dual(x, tx, 0),
                        at::_make_dual(y, ty, 0));
  auto [primal, tangent] = at::_unpack_dual(out, 0);
  // The same function of ATen ops.
  at::Tensor ref = at::sin(at::_make_dual(x, tx, 0)) * at::_make_dual(y, ty, 0);
  auto [ref_primal, ref_tangent] = at::_unpack_dual(ref, 0);
  EXPECT_TRUE(at::allclose(primal, ref_primal));
  ASSERT_TRUE(tangent.defined());
  EXPECT_TRUE(at::allclose(tangent, ref_tangent));
  // A tangent on one argument only.
  out = call("opaque_cpp_transforms::sin_mul", x, at::_make_dual(y, ty, 0));
  EXPECT_TRUE(at::allclose(std::get<1>(at::_unpack_dual(out, 0)), ty * at::sin(x)));
}

TEST(CppTransforms, JvpEqualsFiniteDifferences) {
  at::Tensor x = at::randn({5}, at::kDouble), y = at::randn({5}, at::kDouble);
  at::Tensor tx = at::randn({5}, at::kDouble);
  DualLevel level;
  at::Tensor out = call("opaque_cpp_transforms::sin_mul", at::_make_dual(x, tx, 0), y);
  const double eps = 1e-6;
  at::Tensor fd = (call("opaque_cpp_transforms::sin_mul", x + eps * tx, y) -
                   call("opaque_cpp_transforms::sin_mul", x - eps * tx, y)) / (2 * eps);
  EXPECT_TRUE(at::allclose(std::get<1>(at::_unpack_dual(out, 0)), fd, 1e-6, 1e-6));
}

TEST(CppTransforms, OpWithoutJvpRaisesTorchsError) {
  at::Tensor x = at::randn({3}), y = at::randn({3});
  DualLevel level;
  try {
    call("opaque_cpp_transforms::sin_mul_no_jvp", at::_make_dual(x, at::randn({3}), 0), y);
    FAIL() << "expected an error";
  } catch (const c10::NotImplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("You must implement the jvp function"),
              std::string::npos);
  }
}

TEST(CppTransforms, JvpWithWrongTangentCountIsAClearError) {
  DualLevel level;
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("opaque_cpp_transforms::bad_jvp", "");
  at::Tensor x = at::_make_dual(at::randn({3}), at::randn({3}), 0);
  try {
    op.typed<at::Tensor(const at::Tensor&)>().call(x);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("jvp returned 2 tangents, but forward returns 1 "
                                         "outputs. Return one tangent per output"),
              std::string::npos)
        << e.what();
  }
}

} // namespace
