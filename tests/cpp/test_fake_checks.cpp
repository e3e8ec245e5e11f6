// GoogleTest suite for data-dependent sizes in a C++ fake and the debug-mode
// check of forwards against their fakes (torch_opaque/fake_checks.h).
#include <torch_opaque/op.h>

#include "op_test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace {

// The elements above 0. Its fake guesses the size: x.numel(), an upper bound.
struct PositiveUpperBound {
  static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) {
    return x.masked_select(x > 0);
  }
  static at::Tensor fake(torch_opaque::Context&, const at::Tensor& x) {
    return at::empty({x.numel()}, x.options());
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor>) {
    return {at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(PositiveUpperBound, "opaque_fake_test::positive_upper_bound", "x");

// The same with a dynamic size in its fake.
struct PositiveDynamic {
  static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) {
    return x.masked_select(x > 0);
  }
  static at::Tensor fake(torch_opaque::Context& ctx, const at::Tensor& x) {
    return at::empty_symint({ctx.new_dynamic_size()}, x.options());
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor>) {
    return {at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(PositiveDynamic, "opaque_fake_test::positive_dynamic", "x");

at::Tensor call(const char* name, const at::Tensor& x) {
  return torch_opaque_test::call_op(name, {x});
}

using torch_opaque_test::error_of;

struct DebugMode {
  explicit DebugMode(bool on) : saved(torch_opaque::debug_enabled()) {
    torch_opaque::set_debug(on);
  }
  ~DebugMode() { torch_opaque::set_debug(saved); }
  bool saved;
};

} // namespace

TEST(FakeChecks, DebugModeCatchesAFakeWithTheWrongSize) {
  auto x = torch::tensor({1.0, -2.0, 3.0, -4.0});
  {
    DebugMode off(false);
    EXPECT_EQ(call("opaque_fake_test::positive_upper_bound", x).numel(), 2);
  }
  DebugMode on(true);
  const std::string what =
      error_of([&] { call("opaque_fake_test::positive_upper_bound", x); });
  EXPECT_NE(what.find("opaque_fake_test::positive_upper_bound: output 0 of the forward is [2] "
                      "(Float), but the op's fake gives [4] (Float) for the same inputs "
                      "(debug check)"),
            std::string::npos)
      << what;
  // the training path (`_fwd`) is checked too
  const std::string what_fwd = error_of(
      [&] { call("opaque_fake_test::positive_upper_bound", x.clone().requires_grad_()); });
  EXPECT_NE(what_fwd.find("but the op's fake gives [4]"), std::string::npos) << what_fwd;
  // all elements positive: the guess happens to be right
  EXPECT_EQ(call("opaque_fake_test::positive_upper_bound", x.abs()).numel(), 4);
}

TEST(FakeChecks, DebugModeSkipsFakesWithDynamicSizes) {
  DebugMode on(true);
  auto x = torch::tensor({1.0, -2.0, 3.0});
  EXPECT_TRUE(torch::allclose(call("opaque_fake_test::positive_dynamic", x),
                              torch::tensor({1.0, 3.0})));
}

TEST(FakeChecks, DynamicSizesNeedAFakeTracingContext) {
  // On meta tensors, without Python (no fake tensor mode), the fake cannot
  // create a data-dependent size: a clear error.
  auto x = torch::empty({3}, torch::kMeta);
  const std::string what = error_of([&] { call("opaque_fake_test::positive_dynamic", x); });
  EXPECT_NE(what.find("torch_opaque: ctx.new_dynamic_size() creates a data-dependent size while "
                      "torch.export or torch.compile traces the op with fake tensors"),
            std::string::npos)
      << what;
}
