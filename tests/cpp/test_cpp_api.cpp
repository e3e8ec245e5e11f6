// GoogleTest suite for the C++ authoring API (torch_opaque/op.h).
#include <torch_opaque/op.h>
#include <torch_opaque/detail/saved_data_codec.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace {

// sin(x) * scale; saves x and keeps scale in saved_data.
struct ScaledSin {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, double scale) {
    ctx.save_for_backward({x});
    ctx.saved_data["scale"] = scale;
    return at::sin(x) * scale;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const at::Tensor& x = ctx.saved_tensors()[0];
    return {grads[0] * at::cos(x) * ctx.saved_data["scale"].toDouble(), at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(ScaledSin, "opaque_cpp_test::scaled_sin", "x", "scale");

// Two outputs: (max over the last dim * weight, argmax). The argmax is not
// differentiable; records what it saw in needs_input_grad.
std::vector<bool> g_needs;
struct WeightedMax {
  static std::tuple<at::Tensor, at::Tensor> forward(torch_opaque::Context& ctx,
                                                   const at::Tensor& x,
                                                   const std::optional<at::Tensor>& weight,
                                                   int64_t dim) {
    g_needs = ctx.needs_input_grad();
    auto [values, idx] = x.max(dim);
    at::Tensor out = weight.has_value() ? values * *weight : values * 1;
    ctx.mark_non_differentiable({idx});
    ctx.save_for_backward({idx, values, weight.value_or(at::Tensor())});
    ctx.saved_data["dim"] = dim;
    ctx.saved_data["shape"] = x.sizes().vec();
    ctx.saved_data["name"] = std::string("w;eird=name%");
    return {out, idx};
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const auto& saved = ctx.saved_tensors();
    const at::Tensor& idx = saved[0];
    const at::Tensor& values = saved[1];
    const at::Tensor& weight = saved[2];
    int64_t dim = ctx.saved_data["dim"].toInt();
    auto shape = ctx.saved_data["shape"].toIntVector();
    EXPECT_EQ(ctx.saved_data["name"].toStringRef(), "w;eird=name%");
    at::Tensor g = weight.defined() ? grads[0] * weight : grads[0];
    at::Tensor gx;
    if (ctx.needs_input_grad(0)) {
      gx = at::zeros(shape, g.options()).scatter(dim, idx.unsqueeze(dim), g.unsqueeze(dim));
    }
    at::Tensor gw;
    if (ctx.needs_input_grad(1)) gw = grads[0] * values;
    return {gx, gw, at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(WeightedMax, "opaque_cpp_test::weighted_max", "x", "weight", "dim");

// A forward that is not made of ATen ops on meta tensors: uses data_ptr.
struct DataPtrDouble {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x) {
    at::Tensor out = at::empty_like(x);
    auto src = x.contiguous();
    for (int64_t i = 0; i < x.numel(); ++i) out.data_ptr<float>()[i] = 2 * src.data_ptr<float>()[i];
    return out;
  }
  static at::Tensor fake(torch_opaque::Context& ctx, const at::Tensor& x) {
    return at::empty_like(x);
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor> g) {
    return {g[0] * 2};
  }
};
TORCH_OPAQUE_DEF(DataPtrDouble, "opaque_cpp_test::data_ptr_double", "x");

// The argument types ATen kernels take: view types, optionals, Scalar, Device.
struct ManyTypes {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x,
                            at::IntArrayRef dims, std::string_view mode,
                            std::optional<double> scale, std::optional<int64_t> offset,
                            const at::Scalar& bias, c10::Device device,
                            std::optional<at::ScalarType> dtype, at::TensorList extra) {
    at::Tensor y = mode == "sum" ? x.sum(dims, /*keepdim=*/true) : x.amax(dims, true);
    y = y * scale.value_or(1.0) + offset.value_or(0) + bias;
    for (const at::Tensor& e : extra) y = y + e.sum();
    ctx.save_for_backward({x});
    ctx.saved_data["scale"] = scale.value_or(1.0);
    return y.to(device, dtype.value_or(y.scalar_type()));
  }
  // (the gradient of the "sum" mode)
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> g) {
    const at::Tensor& x = ctx.saved_tensors()[0];
    return {g[0].expand_as(x) * ctx.saved_data["scale"].toDouble(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(ManyTypes, "opaque_cpp_test::many_types", "x", "dims", "mode", "scale",
                 "offset", "bias", "device", "dtype", "extra");

c10::OperatorHandle find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

std::vector<at::Tensor> call(const char* name, std::vector<c10::IValue> args) {
  torch::jit::Stack stack(args.begin(), args.end());
  find(name).callBoxed(stack);
  std::vector<at::Tensor> out;
  for (auto& v : stack) out.push_back(v.toTensor());
  return out;
}

} // namespace

TEST(CppApi, SchemasAreInferredFromSignatures) {
  EXPECT_EQ(c10::toString(find("opaque_cpp_test::scaled_sin").schema()),
            "opaque_cpp_test::scaled_sin(Tensor x, float scale) -> Tensor");
  EXPECT_EQ(c10::toString(find("opaque_cpp_test::weighted_max").schema()),
            "opaque_cpp_test::weighted_max(Tensor x, Tensor? weight, int dim) -> (Tensor, Tensor)");
  EXPECT_TRUE(c10::Dispatcher::singleton().findSchema({"opaque_cpp_test::scaled_sin_bwd", ""}));
}

TEST(CppApi, ArgumentTypesOfAtenKernels) {
  EXPECT_EQ(c10::toString(find("opaque_cpp_test::many_types").schema()),
            "opaque_cpp_test::many_types(Tensor x, int[] dims, str mode, float? scale, "
            "int? offset, Scalar bias, Device device, ScalarType? dtype, Tensor[] extra) -> "
            "Tensor");
  auto x = torch::randn({2, 3}).requires_grad_();
  auto extra = c10::List<at::Tensor>({torch::ones({2})});
  auto y = call("opaque_cpp_test::many_types",
                {x, std::vector<int64_t>{1}, std::string("sum"), 2.0, c10::IValue(),
                 at::Scalar(3), c10::Device("cpu"), c10::IValue(), extra})[0];
  EXPECT_TRUE(torch::allclose(y, x.detach().sum({1}, true) * 2 + 3 + 2));
  auto g = torch::autograd::grad({y.sum()}, {x})[0];
  EXPECT_TRUE(torch::allclose(g, torch::full_like(x, 2.0)));
  auto z = call("opaque_cpp_test::many_types",
                {x.detach(), std::vector<int64_t>{0}, std::string("max"), c10::IValue(),
                 int64_t(1), at::Scalar(0.5), c10::Device("cpu"), at::kDouble,
                 c10::List<at::Tensor>()})[0];
  EXPECT_EQ(z.scalar_type(), at::kDouble);
  EXPECT_TRUE(torch::allclose(z, (x.detach().amax({0}, true) + 1.5).to(at::kDouble)));
}

TEST(CppApi, ForwardValuesAndGradientsMatchFiniteDifferences) {
  auto x = torch::randn({6}, torch::kDouble).requires_grad_();
  auto y = call("opaque_cpp_test::scaled_sin", {x, 1.5})[0];
  EXPECT_TRUE(torch::allclose(y, x.detach().sin() * 1.5));
  auto g = torch::autograd::grad({y.sum()}, {x})[0];
  const double eps = 1e-6;
  for (int64_t i = 0; i < 6; ++i) {
    auto xp = x.detach().clone(), xm = x.detach().clone();
    xp[i] += eps;
    xm[i] -= eps;
    double fd = ((call("opaque_cpp_test::scaled_sin", {xp, 1.5})[0].sum() -
                  call("opaque_cpp_test::scaled_sin", {xm, 1.5})[0].sum()) /
                 (2 * eps)).item<double>();
    EXPECT_NEAR(fd, g[i].item<double>(), 1e-6);
  }
}

TEST(CppApi, BackwardWrittenWithAtenOpsIsDifferentiable) {
  // d2/dx2 of sum(sin(x) * 1.5) through the op's backward (create_graph=true).
  auto x = torch::randn({5}, torch::kDouble).requires_grad_();
  auto y = call("opaque_cpp_test::scaled_sin", {x, 1.5})[0];
  auto g = torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true,
                                 /*create_graph=*/true)[0];
  ASSERT_TRUE(g.requires_grad());
  auto h = torch::autograd::grad({g.sum()}, {x})[0];
  EXPECT_TRUE(torch::allclose(h, -1.5 * x.detach().sin()));
}

TEST(CppApi, TwoOutputsNonDifferentiableSavedStateAndNeedsInputGrad) {
  auto x = torch::randn({3, 4}, torch::kDouble).requires_grad_();
  auto w = torch::randn({3}, torch::kDouble);
  auto outs = call("opaque_cpp_test::weighted_max", {x, w, int64_t(1)});
  EXPECT_EQ(g_needs, (std::vector<bool>{true, false, false}));
  EXPECT_TRUE(outs[0].requires_grad());
  EXPECT_FALSE(outs[1].requires_grad());
  EXPECT_EQ(outs[1].scalar_type(), at::kLong);
  auto gx = torch::autograd::grad({outs[0].sum()}, {x})[0];
  auto expect = at::zeros({3, 4}, at::kDouble)
                    .scatter(1, outs[1].unsqueeze(1), w.unsqueeze(1));
  EXPECT_TRUE(torch::allclose(gx, expect));
  // weight requires grad too; None weight gives the plain max
  auto w2 = w.clone().requires_grad_();
  auto outs2 = call("opaque_cpp_test::weighted_max", {x, w2, int64_t(1)});
  auto grads = torch::autograd::grad({outs2[0].sum()}, {x, w2});
  EXPECT_TRUE(torch::allclose(grads[1], std::get<0>(x.detach().max(1))));
  auto plain = call("opaque_cpp_test::weighted_max", {x, c10::IValue(), int64_t(0)});
  EXPECT_TRUE(torch::allclose(plain[0], std::get<0>(x.detach().max(0))));
}

TEST(CppApi, MetaTensorsUseForwardOrFake) {
  auto x = torch::empty({5, 7}, torch::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  auto outs = call("opaque_cpp_test::weighted_max", {x, c10::IValue(), int64_t(1)});
  EXPECT_EQ(outs[0].sizes(), (at::IntArrayRef{5}));
  EXPECT_TRUE(outs[0].is_meta());
  auto d = call("opaque_cpp_test::data_ptr_double", {x})[0];
  EXPECT_EQ(d.sizes(), x.sizes());
  EXPECT_TRUE(d.is_meta());
  auto real = torch::randn({4});
  EXPECT_TRUE(torch::allclose(call("opaque_cpp_test::data_ptr_double", {real})[0], real * 2));
}

TEST(CppApi, SavedDataRoundTrips) {
  std::map<std::string, c10::IValue> data;
  data["i"] = int64_t(-42);
  data["f"] = 0.1;
  data["b"] = true;
  data["s"] = std::string("a;b=c%d,e");
  data["n"] = c10::IValue();
  data["I"] = std::vector<int64_t>{1, -2, 3};
  data["F"] = std::vector<double>{1.5, -2.25};
  data["B"] = c10::List<bool>({true, false});
  data["E"] = std::vector<int64_t>{};
  EXPECT_NO_THROW(torch_opaque::detail::check_saved_data("t", data));
  std::vector<c10::SymInt> ints;
  std::string s = torch_opaque::detail::encode_saved_data("t", data, &ints);
  auto back = torch_opaque::detail::decode_saved_data(s, ints);
  EXPECT_EQ(back["i"].toInt(), -42);
  EXPECT_EQ(back["f"].toDouble(), 0.1);
  EXPECT_TRUE(back["b"].toBool());
  EXPECT_EQ(back["s"].toStringRef(), "a;b=c%d,e");
  EXPECT_TRUE(back["n"].isNone());
  EXPECT_EQ(back["I"].toIntVector(), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(back["F"].toDoubleVector(), (std::vector<double>{1.5, -2.25}));
  EXPECT_EQ(back["B"].toBoolList().get(1), false);
  EXPECT_TRUE(back["E"].toIntVector().empty());
}

TEST(CppApi, UnsupportedSavedDataIsAClearError) {
  std::map<std::string, c10::IValue> data;
  data["t"] = at::ones({1});
  std::vector<c10::SymInt> ints;
  try {
    torch_opaque::detail::encode_saved_data("my::op", data, &ints);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ctx.saved_data[\"t\"] holds a Tensor"), std::string::npos)
        << e.what();
  }
}

// Keeps a tensor in saved_data, which the backward op cannot take.
struct TensorInSavedData {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x) {
    ctx.saved_data["t"] = x;
    return x * 2;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor> grads) {
    return {grads[0] * 2};
  }
};
TORCH_OPAQUE_DEF(TensorInSavedData, "opaque_cpp_test::tensor_in_saved_data", "x");

TEST(CppApi, UnsupportedSavedDataFailsTheForwardCall) {
  at::Tensor x = torch::ones({2}, torch::requires_grad());
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("opaque_cpp_test::tensor_in_saved_data", "")
                .typed<at::Tensor(const at::Tensor&)>();
  try {
    op.call(x);
    FAIL() << "the forward should have been refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ctx.saved_data[\"t\"] holds a Tensor"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(torch::equal(op.call(x.detach()), x.detach() * 2));  // not recorded: no state
}

// Its backward reads saved_data["k"], then overwrites it.
struct ConsumesSavedData {
  static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x, double k) {
    ctx.saved_data["k"] = k;
    ctx.saved_data["shape"] = x.sizes().vec();
    return x * k;
  }
  static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
                                          std::vector<at::Tensor> grads) {
    const double k = ctx.saved_data["k"].toDouble();
    EXPECT_EQ(ctx.saved_data["shape"].toIntVector(), grads[0].sizes().vec());
    ctx.saved_data["k"] = -1.0;
    return {grads[0] * k, at::Tensor()};
  }
};
TORCH_OPAQUE_DEF(ConsumesSavedData, "opaque_cpp_test::consumes_saved_data", "x", "k");

// Note [Eager context state]: an eager backward gets the forward's own
// saved_data, and each run of the node a fresh copy of it.
TEST(CppApi, EachBackwardRunSeesTheForwardsSavedData) {
  at::Tensor x = torch::randn({3}, torch::requires_grad());
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("opaque_cpp_test::consumes_saved_data", "")
                .typed<at::Tensor(const at::Tensor&, double)>();
  at::Tensor y = op.call(x, 0.1).sum();
  for (int run = 0; run < 2; ++run) {
    at::Tensor g = torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true)[0];
    EXPECT_TRUE(torch::equal(g, torch::full({3}, 0.1))) << "run " << run << ": " << g;
  }
}

TEST(CppApi, RegistrationErrorsNameTheFix) {
  try {
    torch_opaque::def<ScaledSin>("opaque_cpp_test::other", {"x"});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 argument names given, but forward takes 2"),
              std::string::npos)
        << e.what();
  }
  try {
    torch_opaque::def<ScaledSin>("no_namespace", {"x", "scale"});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the name must be qualified"), std::string::npos);
  }
}

TEST(CppApi, StaticRegistrationFailuresAreRecordedNotThrown) {
  // What TORCH_OPAQUE_DEF does at load time (Note [Static registration errors]).
  torch_opaque::take_registration_errors();
  torch_opaque::detail::StaticDefinition<ScaledSin, 2> dup("opaque_cpp_test::scaled_sin",
                                                           {"x", "scale"});
  torch_opaque::detail::StaticDefinition<ScaledSin, 2> bad("no_namespace", {"x", "scale"});
  EXPECT_EQ(dup.op, nullptr);
  EXPECT_EQ(bad.op, nullptr);
  try {
    torch_opaque::check_registrations();
    FAIL();
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("2 op registration(s) failed while loading"), std::string::npos) << what;
    EXPECT_NE(what.find("opaque_cpp_test::scaled_sin is already defined"), std::string::npos)
        << what;
    EXPECT_NE(what.find("the name must be qualified"), std::string::npos) << what;
  }
  torch_opaque::check_registrations(); // emptied: no second throw
  EXPECT_TRUE(torch_opaque::take_registration_errors().empty());
}

TEST(CppApi, BackwardReturningWrongCountIsAClearError) {
  struct Bad {
    static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) { return x * 2; }
    static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor>) {
      return {};
    }
  };
  torch_opaque::def<Bad>("opaque_cpp_test::bad_count", {"x"});
  auto x = torch::randn({2}).requires_grad_();
  auto y = call("opaque_cpp_test::bad_count", {x})[0];
  try {
    y.sum().backward();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("backward returned 0 gradients, but forward takes 1"),
              std::string::npos)
        << e.what();
  }
}
