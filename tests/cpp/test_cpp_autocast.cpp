// GoogleTest suite for the autocast variant of C++ ops (Note [Autocast in the
// call: C++ ops] in csrc/autocast_variant.cpp), without Python: at::autocast's
// thread-local state as torch.autocast sets it.
#include <torch_opaque/op.h>

#include "op_test_util.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

struct AutocastMatmul {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx.save_for_backward({x, w});
    return at::matmul(x, w);
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const auto& s = ctx.saved_tensors();
    const at::Tensor& g = grads[0];
    return {at::matmul(g, s[1].t().to(g.scalar_type())),
            at::matmul(s[0].t().to(g.scalar_type()), g).to(s[1].scalar_type())};
  }
};
TORCH_OPAQUE_DEF(AutocastMatmul, "opaque_cpp_autocast_test::matmul", "x", "w");

// torch.autocast("cpu", dtype=torch.bfloat16) for a scope.
struct CpuAutocast {
  CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  }
};

using torch_opaque_test::call_op;
using torch_opaque_test::error_of;

TEST(CppAutocast, OpFollowsTheCallersAutocastLikeItsAtenCalls) {
  torch::manual_seed(0);
  at::Tensor x = torch::randn({2, 3}), w = torch::randn({3, 4});
  at::Tensor ref, got;
  {
    CpuAutocast autocast;
    ref = at::matmul(x, w);
    got = call_op("opaque_cpp_autocast_test::matmul", {x, w});
  }
  EXPECT_EQ(ref.scalar_type(), at::kBFloat16);
  EXPECT_EQ(got.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::equal(got, ref));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(call_op("opaque_cpp_autocast_test::matmul", {x, w}).scalar_type(), at::kFloat);
}

TEST(CppAutocast, VariantRunsUnderItsStateWithoutAutocastAround) {
  torch::manual_seed(0);
  at::Tensor x = torch::randn({2, 3}).requires_grad_(), w = torch::randn({3, 4});
  at::Tensor y = call_op("opaque_cpp_autocast_test::matmul_autocast",
                         {x, w, std::string("cpu:torch.bfloat16")});
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));  // left as it was
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  at::Tensor ref;
  {
    CpuAutocast autocast;
    ref = at::matmul(x.detach(), w);
  }
  EXPECT_TRUE(torch::equal(y.detach(), ref));
  // the backward is the base's, without autocast; the state has no gradient
  y.to(at::kFloat).sum().backward();
  ASSERT_TRUE(x.grad().defined());
  at::Tensor g = torch::ones({2, 4}, at::kBFloat16);
  EXPECT_TRUE(torch::allclose(x.grad(), at::matmul(g, w.t().to(at::kBFloat16)).to(at::kFloat)));
  // ';'-separated parts, one per device; the call's tensors are on the CPU
  EXPECT_EQ(call_op("opaque_cpp_autocast_test::matmul_autocast",
                    {x, w, std::string("cuda:torch.float16;cpu:torch.bfloat16")})
                .scalar_type(),
            at::kBFloat16);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
  // an empty state is no autocast
  EXPECT_EQ(call_op("opaque_cpp_autocast_test::matmul_autocast", {x, w, std::string("")})
                .scalar_type(),
            at::kFloat);
}

TEST(CppAutocast, StateThatIsNotOneIsAClearError) {
  at::Tensor x = torch::randn({2, 3}), w = torch::randn({3, 4});
  for (const char* bad : {"cpu:torch.notatype", "gpu9:torch.bfloat16", "cpu", "cpu:bfloat16"}) {
    std::string message = error_of([&] {
      call_op("opaque_cpp_autocast_test::matmul_autocast", {x, w, std::string(bad)});
    });
    EXPECT_NE(message.find("opaque_cpp_autocast_test::matmul_autocast: autocast state '" +
                           std::string(bad) + "' is not '<device type>:<dtype>' of a device "
                           "autocast knows"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("torch.bfloat16, torch.float32"), std::string::npos) << message;
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
}

TEST(CppAutocast, VariantSchemaTakesTheStateLast) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "opaque_cpp_autocast_test::matmul_autocast", "");
  EXPECT_EQ(toString(op.schema()),
            "opaque_cpp_autocast_test::matmul_autocast(Tensor x, Tensor w, str "
            "autocast_state=\"\") -> Tensor");
  EXPECT_TRUE(c10::Dispatcher::singleton().findSchema(
      {"opaque_cpp_autocast_test::matmul_autocast_bwd", ""}));
  // the variant has no Autocast kernel of its own; the base has
  EXPECT_TRUE(c10::Dispatcher::singleton()
                  .findSchemaOrThrow("opaque_cpp_autocast_test::matmul", "")
                  .hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));
  EXPECT_FALSE(op.hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));
}

TEST(CppAutocast, VariantNameTakenIsAClearError) {
  // an op already named like the variant of the next one
  torch_opaque::def<AutocastMatmul>("opaque_cpp_autocast_test::taken_autocast", {"x", "w"});
  std::string message = error_of([] {
    torch_opaque::def<AutocastMatmul>("opaque_cpp_autocast_test::taken", {"x", "w"});
  });
  EXPECT_NE(message.find("opaque_cpp_autocast_test::taken is defined, but not its autocast "
                         "variant opaque_cpp_autocast_test::taken_autocast"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("Rename the op"), std::string::npos) << message;
  EXPECT_NE(message.find("opaque_cpp_autocast_test::taken_autocast is already defined"),
            std::string::npos)
      << message;
}

} // namespace
