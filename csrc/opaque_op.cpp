#include <torch_opaque/detail/autocast_variant.h>
#include <torch_opaque/detail/finishers.h>
#include <torch_opaque/fake_checks.h>
#include <torch_opaque/opaque_op.h>

#include "autograd_kernel.h"
#include "in_place.h"
#include "per_sample_batching.h"

#include <ATen/core/op_registration/op_registration.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <sstream>
#include <utility>

namespace torch_opaque {
namespace {

// `ns::Name_fwd`: the trailing `needs_input_grad` argument is handed to the
// user kernel through take_needs_input_grad(), so kernels see exactly the
// arguments of `ns::Name`.
void call_forward(const BoxedKernel& fn, const c10::FunctionSchema& fwd_schema,
                  torch::jit::Stack* stack) {
  c10::IValue needs = std::move(stack->back());
  stack->pop_back();
  std::optional<std::vector<bool>> flags;
  if (!needs.isNone()) {
    auto list = needs.toBoolList();
    flags.emplace(list.begin(), list.end());
  }
  detail::set_needs_input_grad(std::move(flags));
  fn(fwd_schema, stack);
  take_needs_input_grad();  // in case the kernel did not take them
}

// Note [Debug mode] (fake_checks.h): whether the values are plain tensors
// (not meta, fake or functional ones, no dispatch mode active).
bool plain_values(c10::ArrayRef<c10::IValue> values) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                    c10::DispatchKey::FuncTorchBatched});
  auto plain = [&](const at::Tensor& t) {
    return !t.defined() || (!t.is_meta() && !t.key_set().has_any(traced));
  };
  for (const auto& v : values) {
    if (v.isTensor() && !plain(v.toTensor())) return false;
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (!plain(t)) return false;
      }
    }
  }
  return true;
}

at::Tensor meta_copy(const at::Tensor& t) {
  if (!t.defined()) return t;
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
}

c10::IValue meta_copy(const c10::IValue& v) {
  if (v.isTensor()) return meta_copy(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList().vec()) out.push_back(meta_copy(t));
    return out;
  }
  return v;
}

std::vector<at::Tensor> output_tensors(const c10::IValue& v) {
  if (v.isTensorList()) return v.toTensorList().vec();
  return {v.toTensor()};
}

std::string describe(const at::Tensor& t) {
  std::ostringstream ss;
  ss << t.sizes() << " (" << t.scalar_type() << ")";
  return ss.str();
}

// `_fwd`'s kernel `fn`; in debug mode, on plain tensors, also runs `fake` on
// meta copies of the inputs and compares the outputs.
void call_forward_checked(const std::string& op_name, const BoxedKernel& fn,
                          const BoxedKernel& fake, const c10::FunctionSchema& fwd_schema,
                          torch::jit::Stack* stack) {
  const size_t n_args = fwd_schema.arguments().size() - 1;  // without needs_input_grad
  if (!fake || !debug_enabled() || !plain_values(torch::jit::last(*stack, n_args + 1)) ||
      detail::runs_under_autocast(fwd_schema, torch::jit::last(*stack, n_args + 1).slice(0, n_args))) {
    call_forward(fn, fwd_schema, stack);
    return;
  }
  torch::jit::Stack meta;
  for (const auto& v : torch::jit::last(*stack, n_args + 1).slice(0, n_args)) {
    meta.push_back(meta_copy(v));
  }
  meta.emplace_back();  // needs_input_grad=None: the fake records nothing
  call_forward(fn, fwd_schema, stack);
  try {
    detail::FakeCheckScope scope;
    call_forward(fake, fwd_schema, &meta);
  } catch (const detail::DynamicSizeInCheck&) {
    return;  // a data-dependent size: nothing to compare it with
  }
  const size_t n_out = fwd_schema.returns().size() - 1;  // without residuals
  auto real = torch::jit::last(*stack, n_out + 1);
  for (size_t k = 0; k < n_out; ++k) {
    std::vector<at::Tensor> r = output_tensors(real[k]), f = output_tensors(meta[k]);
    TORCH_CHECK(r.size() == f.size(), "torch_opaque: ", op_name, ": output ", k,
                " of the forward is a list of ", r.size(), " tensors, but the op's fake gives ",
                f.size(), " for the same inputs (debug check). Fix the fake.");
    for (size_t j = 0; j < r.size(); ++j) {
      TORCH_CHECK(r[j].sizes() == f[j].sizes() && r[j].scalar_type() == f[j].scalar_type(),
                  "torch_opaque: ", op_name, ": output ", k,
                  r.size() > 1 || real[k].isTensorList() ? "[" + std::to_string(j) + "]" : "",
                  " of the forward is ", describe(r[j]), ", but the op's fake gives ",
                  describe(f[j]),
                  " for the same inputs (debug check). Traced programs (torch.export, "
                  "torch.compile) are built from the fake's result, so they would compute "
                  "with wrong sizes: make the fake compute the forward's, and give a size "
                  "that depends on the data with ctx.new_dynamic_size().");
    }
  }
}

class ForwardKernel final : public c10::OperatorKernel {
 public:
  // `fake`: the op's fake, for the debug check (Note [Debug mode]).
  explicit ForwardKernel(BoxedKernel fn, BoxedKernel fake = nullptr, std::string op_name = "")
      : fn_(std::move(fn)), fake_(std::move(fake)), op_name_(std::move(op_name)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet,
                  torch::jit::Stack* stack) {
    call_forward_checked(op_name_, fn_, fake_, op.schema(), stack);
  }

 private:
  BoxedKernel fn_, fake_;
  std::string op_name_;
};

// Runs a user kernel for the schema of the op it is registered on.
class UserKernel final : public c10::OperatorKernel {
 public:
  explicit UserKernel(BoxedKernel fn) : fn_(std::move(fn)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet,
                  torch::jit::Stack* stack) {
    fn_(op.schema(), stack);
  }

 private:
  BoxedKernel fn_;
};

// `ns::Name` under vmap for an op with a batched forward (Note [Per-sample
// batching]).
class BatchedForwardKernel final : public c10::OperatorKernel {
 public:
  explicit BatchedForwardKernel(BoxedKernel fn) : fn_(std::move(fn)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet,
                  torch::jit::Stack* stack) {
    detail::batched_forward_kernel(fn_, op, stack);
  }

 private:
  BoxedKernel fn_;
};

// `ns::Name` below autograd: the forward without residuals and without a
// record (nothing will be differentiated).
class InferenceKernel final : public c10::OperatorKernel {
 public:
  InferenceKernel(std::weak_ptr<OpaqueOp> op, bool meta) : op_(std::move(op)), meta_(meta) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet,
                  torch::jit::Stack* stack) {
    auto op = op_.lock();
    TORCH_INTERNAL_ASSERT(op);
    detail::ForwardCallScope scope(std::nullopt);
    at::AutoGradMode no_grad(false);  // forwards run without grad, as in autograd.Function
    const auto& def = op->definition();
    std::vector<at::Tensor> dirty;  // Note [In-place ops]
    if (!def.dirty.empty()) dirty = detail::dirty_arguments(def, *stack, op->num_arguments());
    stack->emplace_back();  // needs_input_grad=None: nothing is recorded
    if (meta_) {
      call_forward(def.meta_forward, op->forward_op().schema(), stack);
    } else {
      call_forward_checked(op->qualified_name(), def.forward, def.meta_forward,
                           op->forward_op().schema(), stack);
    }
    stack->pop_back(); // residuals
    if (!dirty.empty()) detail::write_back(def, dirty, stack, op->num_outputs());
  }

 private:
  std::weak_ptr<OpaqueOp> op_;
  bool meta_;
};

bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

std::string with_overload(const std::string& name, const std::string& overload) {
  return overload.empty() ? name : name + "." + overload;
}

std::string returns_string(const std::vector<std::string>& returns, bool residuals) {
  std::ostringstream ss;
  const size_t n = returns.size() + (residuals ? 1 : 0);
  if (n != 1) ss << "(";
  for (size_t i = 0; i < returns.size(); ++i) ss << (i ? ", " : "") << returns[i];
  // Named returns ("Tensor values") name the residuals too.
  const bool named = !returns.empty() && returns[0].find(' ') != std::string::npos;
  if (residuals) ss << (returns.empty() ? "" : ", ") << (named ? "Tensor[] residuals" : "Tensor[]");
  if (n != 1) ss << ")";
  return ss.str();
}

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

std::vector<std::shared_ptr<OpaqueOp>>& all_ops() {
  // Registrations stay alive for the process; this also keeps Python kernels
  // from being destroyed during interpreter shutdown.
  static auto* ops = new std::vector<std::shared_ptr<OpaqueOp>>();
  return *ops;
}


} // namespace

OpaqueOp::OpaqueOp(OpDefinition def, c10::OperatorHandle op, c10::OperatorHandle fwd,
                   c10::OperatorHandle bwd)
    : def_(std::move(def)),
      qualified_name_(def_.ns + "::" + with_overload(def_.name, def_.overload)),
      op_(std::move(op)),
      fwd_op_(std::move(fwd)),
      bwd_op_(std::move(bwd)),
      num_args_(op_.schema().arguments().size()) {}

std::shared_ptr<OpaqueOp> define_op(OpDefinition def) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const std::string qual = def.ns + "::" + with_overload(def.name, def.overload);
  TORCH_CHECK(is_identifier(def.ns), "torch_opaque: namespace '", def.ns,
              "' is not a valid identifier; use letters, digits and '_'.");
  TORCH_CHECK(is_identifier(def.name), "torch_opaque: op name '", def.name,
              "' is not a valid identifier; use letters, digits and '_'.");
  TORCH_CHECK(def.overload.empty() || is_identifier(def.overload),
              "torch_opaque: overload name '", def.overload,
              "' is not a valid identifier; use letters, digits and '_'.");
  TORCH_CHECK(!def.returns.empty(), "torch_opaque: ", qual,
              " must return at least one tensor.");
  TORCH_CHECK(def.forward && (def.backward || def.direct_backward), "torch_opaque: ", qual,
              " needs both a forward and a backward kernel.");
  if (!def.backward) def.backward = detail::boxed_backward(def.direct_backward);
  TORCH_CHECK(def.arguments.find(" needs_input_grad") == std::string::npos, "torch_opaque: ",
              qual, " has an argument named 'needs_input_grad', which `", def.name,
              "_fwd` uses itself; rename the argument.");
  auto& dispatcher = c10::Dispatcher::singleton();
  TORCH_CHECK(!def.jvp || def.arguments.find(" tangents") == std::string::npos,
              "torch_opaque: ", qual, " has an argument named 'tangents', which `", def.name,
              "_jvp` uses itself; rename the argument.");
  for (const std::string& r : def.returns) {
    TORCH_CHECK(!def.jvp || r.rfind("Tensor[]", 0) != 0, "torch_opaque: ", qual,
                ": a jvp is not supported for an op with a Tensor[] output.");
  }
  TORCH_CHECK(!def.per_sample_batching || def.dirty.empty(), "torch_opaque: ", qual,
              ": per-sample batching of in-place ops is not supported.");
  for (const char* suffix : {"", "_fwd", "_bwd", "_jvp"}) {
    if (!def.jvp && std::string(suffix) == "_jvp") continue;
    TORCH_CHECK(!dispatcher.findSchema({def.ns + "::" + def.name + suffix, def.overload}),
                "torch_opaque: ", def.ns, "::", with_overload(def.name + suffix, def.overload),
                " is already defined. Pick another name (or overload), or reuse the "
                "existing op.");
  }

  const std::string main_schema = with_overload(def.name, def.overload) + "(" +
      def.arguments + ") -> " + returns_string(def.returns, false);
  // Note [needs_input_grad of _fwd]
  // What the forward saves may depend on ctx.needs_input_grad, so `_fwd` takes
  // it as an argument: a traced training graph replays the flags it was traced
  // with, and `_fwd` called from a compiled graph returns the same residuals.
  const std::string fwd_schema = with_overload(def.name + "_fwd", def.overload) + "(" +
      def.arguments + (def.arguments.empty() ? "" : ", ") +
      "bool[]? needs_input_grad=None) -> " + returns_string(def.returns, true);
  const std::string bwd_schema = with_overload(def.name + "_bwd", def.overload) +
      "(Tensor?[] saved, Tensor?[] grads, bool[] needs_input_grad, str state, "
      "SymInt[] state_ints) -> Tensor?[]";

  // Note [C++ jvp] (detail/jvp_finisher.h): the schema Python Functions'
  // `Name_jvp` has (torch_opaque/_impl/forward_ad.py), plain return types.
  std::string jvp_schema;
  if (def.jvp) {
    jvp_schema = with_overload(def.name + "_jvp", def.overload) + "(" + def.arguments +
        (def.arguments.empty() ? "" : ", ") + "Tensor?[] tangents) -> (";
    for (size_t k = 0; k < def.returns.size(); ++k) {
      const std::string& r = def.returns[k];
      jvp_schema += r.substr(0, r.find(' ')) + ", ";
    }
    jvp_schema += "Tensor[])";
  }

  auto lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, def.ns,
                                              std::nullopt, __FILE__, __LINE__);
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  TORCH_CHECK(def.dirty.empty() || !def.differentiate_lists, "torch_opaque: ", qual,
              ": in-place ops (dirty arguments) differentiate no tensor lists.");
  for (const auto& [k, i] : def.dirty) {
    TORCH_CHECK(k < def.returns.size() && def.returns[k] == "Tensor", "torch_opaque: ", qual,
                ": dirty output ", k, " is not a Tensor output.");
  }
  try {
    if (def.dirty.empty()) {
      lib->def(main_schema.c_str(), tags);
    } else {  // Note [In-place ops]
      lib->def(detail::in_place_schema(torch::schema(main_schema.c_str()), def), tags);
    }
    lib->def(fwd_schema.c_str(), tags);
    lib->def(bwd_schema.c_str(), tags);
    if (def.jvp) lib->def(jvp_schema.c_str(), tags);
  } catch (const std::exception& e) {
    // The schema parser throws torch::jit::ErrorReport, not c10::Error.
    TORCH_CHECK(false, "torch_opaque: cannot define ", qual, " with schema '",
                main_schema, "': ", e.what());
  }
  auto find = [&](const std::string& suffix) {
    return dispatcher.findSchemaOrThrow((def.ns + "::" + def.name + suffix).c_str(),
                                        def.overload.c_str());
  };
  auto op = std::make_shared<OpaqueOp>(def, find(""), find("_fwd"), find("_bwd"));
  std::weak_ptr<OpaqueOp> weak = op;
  const std::string main_name = with_overload(def.name, def.overload);
  lib->impl(main_name.c_str(),
            torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                            torch::CppFunction::makeFromBoxedFunctor(
                                std::make_unique<InferenceKernel>(weak, false))));
  lib->impl(main_name.c_str(),
            torch::dispatch(c10::DispatchKey::Autograd,
                            torch::CppFunction::makeFromBoxedFunctor(
                                std::make_unique<detail::AutogradKernel>(weak))));
  lib->impl(with_overload(def.name + "_fwd", def.overload).c_str(),
            torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                            torch::CppFunction::makeFromBoxedFunctor(
                                std::make_unique<ForwardKernel>(def.forward, def.meta_forward,
                                                                qual))));
  lib->impl(with_overload(def.name + "_bwd", def.overload).c_str(),
            torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                            torch::CppFunction::makeFromBoxedFunctor(
                                std::make_unique<UserKernel>(def.backward))));
  if (def.meta_forward) {
    lib->impl(main_name.c_str(),
              torch::dispatch(c10::DispatchKey::Meta,
                              torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<InferenceKernel>(weak, true))));
    lib->impl(with_overload(def.name + "_fwd", def.overload).c_str(),
              torch::dispatch(c10::DispatchKey::Meta,
                              torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<ForwardKernel>(def.meta_forward))));
  }
  // `_fwd` called with inputs that require grad records the Function's
  // backward node as `ns::Name` does; `_bwd` is differentiable through the
  // operations of the user's backward (Note [Double backward]).
  lib->impl(with_overload(def.name + "_fwd", def.overload).c_str(),
            torch::dispatch(c10::DispatchKey::Autograd,
                            torch::CppFunction::makeFromBoxedFunctor(
                                std::make_unique<detail::AutogradKernel>(weak, true))));
  lib->impl(with_overload(def.name + "_bwd", def.overload).c_str(),
            torch::dispatch(c10::DispatchKey::Autograd,
                            torch::CppFunction::makeFromBoxedFunctor(
                                std::make_unique<detail::BackwardAutogradKernel>())));
  if (def.jvp) {
    lib->impl(with_overload(def.name + "_jvp", def.overload).c_str(),
              torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                              torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<UserKernel>(def.jvp))));
  }
  if (def.per_sample_batching) {  // Note [Per-sample batching]
    if (def.batched_forward) {
      lib->impl(main_name.c_str(),
                torch::dispatch(c10::DispatchKey::FuncTorchBatched,
                                torch::CppFunction::makeFromBoxedFunctor(
                                    std::make_unique<BatchedForwardKernel>(def.batched_forward))));
    }
    for (const char* suffix : {"", "_fwd", "_bwd", "_jvp"}) {
      if (!def.jvp && std::string(suffix) == "_jvp") continue;
      if (def.batched_forward && std::string(suffix).empty()) continue;
      lib->impl(with_overload(def.name + suffix, def.overload).c_str(),
                torch::dispatch(c10::DispatchKey::FuncTorchBatched,
                                torch::CppFunction::makeFromBoxedFunction<
                                    &detail::per_sample_kernel>()));
    }
    // torch's older vmap (the Batched key: autograd.grad(..., is_grads_batched=True),
    // jacobian(vectorize=True)) runs the user's backward and jvp on its batched
    // tensors, as it does a stock Function's.
    lib->impl(with_overload(def.name + "_bwd", def.overload).c_str(),
              torch::dispatch(c10::DispatchKey::Batched,
                              torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<UserKernel>(def.backward))));
    if (def.jvp) {
      lib->impl(with_overload(def.name + "_jvp", def.overload).c_str(),
                torch::dispatch(c10::DispatchKey::Batched,
                                torch::CppFunction::makeFromBoxedFunctor(
                                    std::make_unique<UserKernel>(def.jvp))));
    }
  }
  op->keep_alive(std::move(lib));
  all_ops().push_back(op);
  return op;
}

namespace {
std::mutex& registration_errors_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::string>& registration_errors() {
  static std::vector<std::string> errors;
  return errors;
}
} // namespace

void record_registration_error(std::string message) {
  std::lock_guard<std::mutex> guard(registration_errors_mutex());
  registration_errors().push_back(std::move(message));
}

std::vector<std::string> take_registration_errors() {
  std::lock_guard<std::mutex> guard(registration_errors_mutex());
  return std::exchange(registration_errors(), {});
}

void check_registrations() {
  std::vector<std::string> errors = take_registration_errors();
  if (errors.empty()) return;
  std::ostringstream ss;
  ss << "torch_opaque: " << errors.size() << " op registration(s) failed while loading:";
  for (const auto& e : errors) ss << "\n  - " << e;
  TORCH_CHECK(false, ss.str());
}

bool release_op(const OpaqueOp& op, long users) {
  std::shared_ptr<OpaqueOp> kept;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& ops = all_ops();
    auto it = std::find_if(ops.begin(), ops.end(),
                           [&](const std::shared_ptr<OpaqueOp>& p) { return p.get() == &op; });
    if (it == ops.end()) return true;  // released before
    // all_ops() holds one reference, the caller `users`; any other is a live
    // autograd node that may still run the backward op.
    if (it->use_count() > users + 1) return false;
    kept = std::move(*it);
    ops.erase(it);
  }
  // Outside the lock: destroying the kernels may run Python destructors.
  kept->drop_registrations();
  return true;
}

} // namespace torch_opaque
