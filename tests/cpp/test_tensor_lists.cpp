// GoogleTest suite for Tensor[] arguments of C++ ops: each element gets its
// gradient (Note [Tensor-list gradients]).
#include <torch_opaque/op.h>

#include "op_test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace {

// sum_i w[i] * xs[i]; the gradient of xs is one tensor per element.
struct ListWeightedSum {
  static at::Tensor forward(torch_opaque::Context& ctx, at::TensorList xs, const at::Tensor& w) {
    at::Tensor out = xs[0] * w[0];
    for (size_t i = 1; i < xs.size(); ++i) out = out + xs[i] * w[i];
    std::vector<at::Tensor> saved(xs.begin(), xs.end());
    saved.push_back(w);
    ctx.save_for_backward(saved);
    return out;
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> g) {
    const auto& saved = ctx.saved_tensors();
    const at::Tensor& w = saved.back();
    std::vector<at::Tensor> gxs(saved.size() - 1), gw(saved.size() - 1);
    for (size_t i = 0; i + 1 < saved.size(); ++i) {
      if (i != 1) gxs[i] = g[0] * w[i];  // element 1: no gradient (undefined)
      gw[i] = (g[0] * saved[i]).sum();
    }
    return {gxs, at::stack(gw)};
  }
};
TORCH_OPAQUE_DEF(ListWeightedSum, "opaque_list_test::weighted_sum", "xs", "w");

// Two lists around a tensor; the backward gives no gradient at all (an empty
// list) for the first when it is not needed.
struct TwoLists {
  static at::Tensor forward(torch_opaque::Context& ctx, const std::vector<at::Tensor>& a,
                            const at::Tensor& scale, const std::vector<at::Tensor>& b) {
    ctx.save_for_backward({scale});
    ctx.saved_data["n_a"] = static_cast<int64_t>(a.size());
    ctx.saved_data["n_b"] = static_cast<int64_t>(b.size());
    return (at::stack(a).sum(0) + at::stack(b).sum(0)) * scale;
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> g) {
    const at::Tensor gi = g[0] * ctx.saved_tensors()[0];
    std::vector<at::Tensor> ga, gb(ctx.saved_data["n_b"].toInt(), gi);
    if (ctx.needs_input_grad(0)) ga.assign(ctx.saved_data["n_a"].toInt(), gi);
    return {ga, at::Tensor(), gb};
  }
};
TORCH_OPAQUE_DEF(TwoLists, "opaque_list_test::two_lists", "a", "scale", "b");

// A backward that returns the wrong number of list gradients.
struct ShortListGradient {
  static at::Tensor forward(torch_opaque::Context&, at::TensorList xs) { return at::stack(xs); }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context&,
                                                      std::vector<at::Tensor> g) {
    return {std::vector<at::Tensor>{g[0][0]}};
  }
};
TORCH_OPAQUE_DEF(ShortListGradient, "opaque_list_test::short_list_gradient", "xs");

at::Tensor call(const char* name, std::vector<c10::IValue> args) {
  return torch_opaque_test::call_op(name, std::move(args));
}

using torch_opaque_test::error_of;

} // namespace

TEST(TensorLists, EachElementGetsItsGradient) {
  std::vector<at::Tensor> xs;
  for (int i = 0; i < 3; ++i) xs.push_back(torch::randn({4}, torch::kDouble).requires_grad_());
  auto w = torch::randn({3}, torch::kDouble).requires_grad_();
  auto y = call("opaque_list_test::weighted_sum", {c10::List<at::Tensor>(xs), w});
  EXPECT_TRUE(y.requires_grad());
  auto gy = torch::randn({4}, torch::kDouble);
  auto grads = torch::autograd::grad({y}, {xs[0], xs[2], w}, {gy});
  EXPECT_TRUE(torch::allclose(grads[0], gy * w[0].detach()));
  EXPECT_TRUE(torch::allclose(grads[1], gy * w[2].detach()));
  auto expect_w = torch::stack({(gy * xs[0].detach()).sum(), (gy * xs[1].detach()).sum(),
                                (gy * xs[2].detach()).sum()});
  EXPECT_TRUE(torch::allclose(grads[2], expect_w));
  // Element 1's gradient is undefined: .grad stays unset, as for any input
  // whose gradient a backward leaves undefined.
  y = call("opaque_list_test::weighted_sum", {c10::List<at::Tensor>(xs), w});
  y.sum().backward();
  EXPECT_TRUE(xs[0].grad().defined());
  EXPECT_FALSE(xs[1].grad().defined());
  EXPECT_TRUE(xs[2].grad().defined());
}

TEST(TensorLists, OnlySomeElementsRequireGrad) {
  std::vector<at::Tensor> xs = {torch::randn({2}).requires_grad_(), torch::randn({2})};
  auto w = torch::randn({2});
  auto y = call("opaque_list_test::weighted_sum", {c10::List<at::Tensor>(xs), w});
  EXPECT_TRUE(y.requires_grad());
  auto g = torch::autograd::grad({y.sum()}, {xs[0]})[0];
  EXPECT_TRUE(torch::allclose(g, w[0].expand({2})));
  // nothing requires grad: no graph
  xs[0] = xs[0].detach();
  EXPECT_FALSE(call("opaque_list_test::weighted_sum", {c10::List<at::Tensor>(xs), w})
                   .requires_grad());
}

TEST(TensorLists, TwoListsAndAnEmptyListGradient) {
  EXPECT_EQ(c10::toString(c10::Dispatcher::singleton()
                              .findSchemaOrThrow("opaque_list_test::two_lists", "")
                              .schema()),
            "opaque_list_test::two_lists(Tensor[] a, Tensor scale, Tensor[] b) -> Tensor");
  std::vector<at::Tensor> a = {torch::randn({3}), torch::randn({3})};
  std::vector<at::Tensor> b = {torch::randn({3}).requires_grad_(), torch::randn({3}),
                               torch::randn({3}).requires_grad_()};
  auto scale = torch::tensor(2.0);
  auto y = call("opaque_list_test::two_lists",
                {c10::List<at::Tensor>(a), scale, c10::List<at::Tensor>(b)});
  auto g = torch::autograd::grad({y.sum()}, {b[0], b[2]});
  EXPECT_TRUE(torch::allclose(g[0], torch::full({3}, 2.0)));
  EXPECT_TRUE(torch::allclose(g[1], torch::full({3}, 2.0)));
  a[1].requires_grad_();
  y = call("opaque_list_test::two_lists",
           {c10::List<at::Tensor>(a), scale, c10::List<at::Tensor>(b)});
  g = torch::autograd::grad({y.sum()}, {a[1], b[0]});
  EXPECT_TRUE(torch::allclose(g[0], torch::full({3}, 2.0)));
}

TEST(TensorLists, WrongNumberOfListGradientsIsAClearError) {
  std::vector<at::Tensor> xs = {torch::randn({2}).requires_grad_(), torch::randn({2})};
  auto y = call("opaque_list_test::short_list_gradient", {c10::List<at::Tensor>(xs)});
  const std::string what = error_of([&] { y.sum().backward(); });
  EXPECT_NE(what.find("opaque_list_test::short_list_gradient: backward returned 1 gradients "
                      "for argument 0, a Tensor[] of 2 elements"),
            std::string::npos)
      << what;
}

// Note [Backward results do not alias]: `_bwd`'s results are an op's outputs,
// so one tensor returned for several slots (as two_lists's backward returns gi
// for every element) is copied for all but the first.
TEST(TensorLists, BackwardResultsSharingStorageAreCopied) {
  auto g = torch::randn({2, 3});
  auto other = torch::randn({3});
  std::vector<at::Tensor> result = {g, at::Tensor(), g, g[1], other};
  auto out = torch_opaque::detail::finish_backward("opaque_list_test::shared",
                                                   {true, true, true, true, true}, result, {}, {});
  ASSERT_EQ(out.size(), 5u);
  EXPECT_TRUE(out[0].is_same(g));  // the first keeps its tensor
  EXPECT_FALSE(out[1].defined());
  EXPECT_TRUE(out[4].is_same(other));
  for (size_t i : {2, 3}) {
    EXPECT_FALSE(out[i].is_alias_of(g)) << i;
    EXPECT_FALSE(out[i].is_alias_of(out[0])) << i;
  }
  EXPECT_FALSE(out[2].is_alias_of(out[3]));
  EXPECT_TRUE(torch::equal(out[2], g));
  EXPECT_TRUE(torch::equal(out[3], g[1]));
}
