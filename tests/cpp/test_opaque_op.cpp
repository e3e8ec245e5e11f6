// GoogleTest suite for the C++ core: define_op, the Autograd kernel, the
// backward node and the forward record, with kernels written in C++.
#include <torch_opaque/forward_record.h>
#include <torch_opaque/opaque_op.h>

#include "../../csrc/autograd_kernel.h"  // Note [Raw saved tensors]

#include <gtest/gtest.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/torch.h>

#include <atomic>
#include <string>

using torch_opaque::BoxedKernel;
using torch_opaque::ForwardRecord;
using torch_opaque::OpDefinition;
using torch_opaque::SavedKind;

namespace {

std::string unique_name(const std::string& base) {
  static std::atomic<int> counter{0};
  return base + "_" + std::to_string(counter++);
}

// scaled_sin(x, scale) = sin(x) * scale; saves x (an input), keeps `scale`
// in the record's state string.
OpDefinition scaled_sin_definition(const std::string& name,
                                   std::vector<bool>* seen_needs = nullptr) {
  OpDefinition def;
  def.ns = "opaque_test";
  def.name = name;
  def.arguments = "Tensor x, float scale";
  def.returns = {"Tensor"};
  def.forward = [seen_needs](const c10::FunctionSchema&, torch::jit::Stack* s) {
    double scale = s->back().toDouble();
    at::Tensor x = (*s)[s->size() - 2].toTensor();
    torch::jit::drop(*s, 2);
    s->emplace_back(at::sin(x) * scale);
    s->emplace_back(c10::List<at::Tensor>());
    if (auto needs = torch_opaque::take_needs_input_grad()) {
      if (seen_needs) *seen_needs = *needs;
      ForwardRecord r;
      r.saved = {{SavedKind::Input, 0, 0}};
      r.state = std::to_string(scale);
      torch_opaque::set_forward_record(std::move(r));
    }
  };
  def.backward = [](const c10::FunctionSchema&, torch::jit::Stack* s) {
    auto state_ints = (*s)[4];
    std::string state = (*s)[3].toStringRef();
    auto grads = (*s)[1].toOptionalTensorList();
    auto saved = (*s)[0].toOptionalTensorList();
    torch::jit::drop(*s, 5);
    at::Tensor x = *saved.get(0);
    at::Tensor g = *grads.get(0);
    c10::List<std::optional<at::Tensor>> out;
    out.push_back(g * at::cos(x) * std::stod(state));
    out.push_back(std::nullopt);
    s->emplace_back(std::move(out));
  };
  return def;
}

at::Tensor call(const std::string& qualname, const std::vector<c10::IValue>& args) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(qualname.c_str(), "");
  torch::jit::Stack stack(args.begin(), args.end());
  op.callBoxed(stack);
  return stack.back().toTensor();
}

} // namespace

TEST(OpaqueOp, RegistersThreeOperatorsWithSchemas) {
  auto name = unique_name("sin");
  auto op = torch_opaque::define_op(scaled_sin_definition(name));
  EXPECT_EQ(op->qualified_name(), "opaque_test::" + name);
  EXPECT_EQ(c10::toString(op->op().schema()),
            "opaque_test::" + name + "(Tensor x, float scale) -> Tensor");
  EXPECT_EQ(c10::toString(op->forward_op().schema()),
            "opaque_test::" + name +
                "_fwd(Tensor x, float scale, bool[]? needs_input_grad=None) -> (Tensor, Tensor[])");
  EXPECT_EQ(c10::toString(op->backward_op().schema()),
            "opaque_test::" + name +
                "_bwd(Tensor?[] saved, Tensor?[] grads, bool[] needs_input_grad, str state, "
                "SymInt[] state_ints) -> Tensor?[]");
  EXPECT_TRUE(op->op().hasTag(at::Tag::pt2_compliant_tag));
}

TEST(OpaqueOp, ForwardWithoutGradSkipsTheRecord) {
  auto name = unique_name("sin");
  torch_opaque::define_op(scaled_sin_definition(name));
  auto x = torch::randn({4});
  auto y = call("opaque_test::" + name, {x, 2.0});
  EXPECT_TRUE(torch::allclose(y, x.sin() * 2));
  EXPECT_FALSE(y.requires_grad());
}

TEST(OpaqueOp, GradientMatchesAnalyticAndFiniteDifferences) {
  auto name = unique_name("sin");
  std::vector<bool> needs;
  torch_opaque::define_op(scaled_sin_definition(name, &needs));
  auto x = torch::randn({5}, torch::kDouble).requires_grad_();
  auto y = call("opaque_test::" + name, {x, 3.0});
  ASSERT_TRUE(y.requires_grad());
  EXPECT_EQ(y.grad_fn()->name(), "opaque_test::" + name + "Backward");
  EXPECT_EQ(needs, (std::vector<bool>{true, false}));
  auto g = torch::autograd::grad({y.sum()}, {x})[0];
  EXPECT_TRUE(torch::allclose(g, x.detach().cos() * 3));
  // central finite differences
  const double eps = 1e-6;
  auto xd = x.detach();
  for (int64_t i = 0; i < xd.numel(); ++i) {
    auto xp = xd.clone(), xm = xd.clone();
    xp[i] += eps;
    xm[i] -= eps;
    double fd = ((call("opaque_test::" + name, {xp, 3.0}).sum() -
                  call("opaque_test::" + name, {xm, 3.0}).sum()) / (2 * eps))
                    .item<double>();
    EXPECT_NEAR(fd, g[i].item<double>(), 1e-6);
  }
}

TEST(OpaqueOp, SecondBackwardWithoutRetainGraphFails) {
  auto name = unique_name("sin");
  torch_opaque::define_op(scaled_sin_definition(name));
  auto x = torch::randn({3}).requires_grad_();
  auto y = call("opaque_test::" + name, {x, 1.0}).sum();
  y.backward();
  try {
    y.backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

TEST(OpaqueOp, SavedInputModifiedInPlaceIsDetected) {
  auto name = unique_name("sin");
  torch_opaque::define_op(scaled_sin_definition(name));
  auto leaf = torch::randn({3}).requires_grad_();
  auto x = leaf * 1;
  auto y = call("opaque_test::" + name, {x, 1.0}).sum();
  {
    torch::NoGradGuard g;
    x.add_(1);
  }
  try {
    y.backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"),
              std::string::npos)
        << e.what();
  }
}

// two outputs: (x * 2, argmax-like int output marked non-differentiable);
// saves its first output and a residual; undefined grads stay undefined.
TEST(OpaqueOp, OutputsResidualsAndNonDifferentiableOutputs) {
  OpDefinition def;
  def.ns = "opaque_test";
  def.name = unique_name("two");
  def.arguments = "Tensor x";
  def.returns = {"Tensor", "Tensor"};
  def.forward = [](const c10::FunctionSchema&, torch::jit::Stack* s) {
    at::Tensor x = s->back().toTensor();
    s->pop_back();
    at::Tensor y = x * 2;
    s->emplace_back(y);
    s->emplace_back(x.exp());
    s->emplace_back(c10::List<at::Tensor>({x.square()}));
    if (torch_opaque::take_needs_input_grad()) {
      ForwardRecord r;
      r.saved = {{SavedKind::Output, 0, 0}, {SavedKind::Residual, 0, 0},
                 {SavedKind::None, 0, 0}};
      r.non_differentiable = {false, true};
      r.materialize_grads = false;
      torch_opaque::set_forward_record(std::move(r));
    }
  };
  def.backward = [](const c10::FunctionSchema&, torch::jit::Stack* s) {
    auto grads = (*s)[1].toOptionalTensorList();
    auto saved = (*s)[0].toOptionalTensorList();
    torch::jit::drop(*s, 5);
    EXPECT_EQ(saved.size(), 3u);
    EXPECT_FALSE(saved.get(2).has_value());
    EXPECT_FALSE(grads.get(1).has_value());  // not materialized
    at::Tensor y = *saved.get(0), sq = *saved.get(1);
    c10::List<std::optional<at::Tensor>> out;
    out.push_back(*grads.get(0) * (y / 2 + sq));  // arbitrary but checkable
    s->emplace_back(std::move(out));
  };
  auto op = torch_opaque::define_op(def);
  auto x = torch::randn({4}, torch::kDouble).requires_grad_();
  torch::jit::Stack stack{x};
  op->op().callBoxed(stack);
  ASSERT_EQ(stack.size(), 2u);
  auto y = stack[0].toTensor(), e = stack[1].toTensor();
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(e.requires_grad());
  auto g = torch::autograd::grad({y.sum()}, {x})[0];
  auto xd = x.detach();
  EXPECT_TRUE(torch::allclose(g, xd + xd.square()));
}

TEST(OpaqueOp, MissingRecordIsAClearError) {
  auto def = scaled_sin_definition(unique_name("norecord"));
  def.forward = [](const c10::FunctionSchema&, torch::jit::Stack* s) {
    at::Tensor x = (*s)[s->size() - 2].toTensor();
    torch::jit::drop(*s, 2);
    s->emplace_back(x.sin());
    s->emplace_back(c10::List<at::Tensor>());
  };
  auto op = torch_opaque::define_op(def);
  auto x = torch::randn({2}).requires_grad_();
  try {
    call(op->qualified_name(), {x, 1.0});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not report its saved state"),
              std::string::npos)
        << e.what();
  }
}

TEST(OpaqueOp, DuplicateNameIsRefused) {
  auto name = unique_name("dup");
  torch_opaque::define_op(scaled_sin_definition(name));
  try {
    torch_opaque::define_op(scaled_sin_definition(name));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is already defined"), std::string::npos)
        << e.what();
  }
}

TEST(OpaqueOp, BadSchemaAndNamesAreRefused) {
  auto def = scaled_sin_definition(unique_name("bad"));
  def.arguments = "Tensor x, floot scale";
  EXPECT_THROW(
      {
        try {
          torch_opaque::define_op(def);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("cannot define"), std::string::npos);
          throw;
        }
      },
      c10::Error);
  auto def2 = scaled_sin_definition("not an identifier");
  EXPECT_THROW(torch_opaque::define_op(def2), c10::Error);
}

TEST(OpaqueOp, WrongGradientCountIsAClearError) {
  auto def = scaled_sin_definition(unique_name("count"));
  def.backward = [](const c10::FunctionSchema&, torch::jit::Stack* s) {
    torch::jit::drop(*s, 5);
    s->emplace_back(c10::List<std::optional<at::Tensor>>());
  };
  auto op = torch_opaque::define_op(def);
  auto x = torch::randn({2}).requires_grad_();
  auto y = call(op->qualified_name(), {x, 1.0}).sum();
  try {
    y.backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("one gradient (or None) per forward argument"),
              std::string::npos)
        << e.what();
  }
}

namespace {

// Note [Eager context state]: a forward that keeps its state as an object.
struct ScaleState final : torch_opaque::EagerState {
  explicit ScaleState(double s, std::atomic<int>* encodes) : scale(s), encodes(encodes) {}
  void encode(std::string& state, std::vector<c10::SymInt>&,
              std::vector<at::Tensor>&) const override {
    ++*encodes;
    state = std::to_string(scale);
  }
  double scale;
  std::atomic<int>* encodes;
};

OpDefinition eager_state_definition(const std::string& name, std::atomic<int>* encodes,
                                    int* seen_objects) {
  OpDefinition def = scaled_sin_definition(name);
  def.forward = [encodes](const c10::FunctionSchema&, torch::jit::Stack* s) {
    double scale = s->back().toDouble();
    at::Tensor x = (*s)[s->size() - 2].toTensor();
    torch::jit::drop(*s, 2);
    s->emplace_back(at::sin(x) * scale);
    s->emplace_back(c10::List<at::Tensor>());
    if (torch_opaque::take_needs_input_grad()) {
      ForwardRecord r;
      r.saved = {{SavedKind::Input, 0, 0}};
      r.eager_state = std::make_shared<ScaleState>(scale, encodes);
      torch_opaque::set_forward_record(std::move(r));
    }
  };
  def.backward = [seen_objects](const c10::FunctionSchema& schema, torch::jit::Stack* s) {
    const auto* obj =
        dynamic_cast<const ScaleState*>(torch_opaque::current_eager_state(schema));
    std::string state = (*s)[3].toStringRef();
    auto grads = (*s)[1].toOptionalTensorList();
    auto saved = (*s)[0].toOptionalTensorList();
    torch::jit::drop(*s, 5);
    double scale = obj ? obj->scale : std::stod(state);
    if (obj) ++*seen_objects;
    c10::List<std::optional<at::Tensor>> out;
    out.push_back(*grads.get(0) * at::cos(*saved.get(0)) * scale);
    out.push_back(std::nullopt);
    s->emplace_back(std::move(out));
  };
  return def;
}

} // namespace

TEST(OpaqueOp, EagerStateReachesTheBackwardKernelUnencoded) {
  const std::string name = unique_name("eager_state");
  std::atomic<int> encodes{0};
  int seen_objects = 0;
  torch_opaque::define_op(eager_state_definition(name, &encodes, &seen_objects));
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(("opaque_test::" + name).c_str(), "");
  at::Tensor x = torch::randn({4}, torch::requires_grad());
  at::Tensor y = op.typed<at::Tensor(const at::Tensor&, double)>().call(x, 1.5);
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x.detach().cos() * 1.5));
  EXPECT_EQ(seen_objects, 1);
  EXPECT_EQ(encodes.load(), 0);
  // Outside the backward node's call, no `_bwd` kernel sees the object.
  auto bwd = c10::Dispatcher::singleton().findSchemaOrThrow(
      ("opaque_test::" + name + "_bwd").c_str(), "");
  EXPECT_EQ(torch_opaque::current_eager_state(bwd.schema()), nullptr);
}

namespace {

// Saved-tensor hooks set on one saved tensor after the forward ran, as
// `grad_fn._raw_saved_tensors[i].register_hooks(pack, unpack)` does from Python.
struct CountingHooks final : torch::autograd::SavedVariableHooks {
  int* packs;
  int* unpacks;
  at::Tensor packed;
  CountingHooks(int* p, int* u) : packs(p), unpacks(u) {}
  void call_pack_hook(const at::Tensor& t) override {
    ++*packs;
    packed = t.detach().clone();
  }
  at::Tensor call_unpack_hook() override {
    ++*unpacks;
    return packed * 2;  // the backward sees what the unpack hook gives
  }
};

} // namespace

TEST(OpaqueOp, RawSavedVariablesTakeHooksAfterTheForward) {
  auto name = unique_name("sin");
  torch_opaque::define_op(scaled_sin_definition(name));
  auto x = torch::tensor({0.5, -1.0}, torch::kDouble).requires_grad_();
  auto y = call("opaque_test::" + name, {x, 3.0});
  auto& saved = torch_opaque::detail::opaque_node_saved_variables(*y.grad_fn());
  ASSERT_EQ(saved.size(), 1u);
  int packs = 0, unpacks = 0;
  saved[0].register_hooks(std::make_unique<CountingHooks>(&packs, &unpacks));
  EXPECT_EQ(packs, 1);
  EXPECT_THROW(saved[0].register_hooks(std::make_unique<CountingHooks>(&packs, &unpacks)),
               c10::Error);
  auto g = torch::autograd::grad({y.sum()}, {x})[0];
  EXPECT_EQ(unpacks, 1);
  EXPECT_TRUE(torch::allclose(g, (x.detach() * 2).cos() * 3));
  try {
    torch_opaque::detail::opaque_node_saved_variables(*y.grad_fn());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("freed"), std::string::npos) << e.what();
  }
}
