#include <torch_opaque/opaque_op.h>

#include "autograd_kernel.h"

#include <ATen/core/op_registration/op_registration.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
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

class ForwardKernel final : public c10::OperatorKernel {
 public:
  explicit ForwardKernel(BoxedKernel fn) : fn_(std::move(fn)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet,
                  torch::jit::Stack* stack) {
    call_forward(fn_, op.schema(), stack);
  }

 private:
  BoxedKernel fn_;
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
    stack->emplace_back();  // needs_input_grad=None: nothing is recorded
    call_forward(meta_ ? def.meta_forward : def.forward, op->forward_op().schema(), stack);
    stack->pop_back(); // residuals
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
      op_(std::move(op)),
      fwd_op_(std::move(fwd)),
      bwd_op_(std::move(bwd)),
      num_args_(op_.schema().arguments().size()) {}

std::string OpaqueOp::qualified_name() const {
  return def_.ns + "::" + with_overload(def_.name, def_.overload);
}

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
  TORCH_CHECK(def.forward && def.backward, "torch_opaque: ", qual,
              " needs both a forward and a backward kernel.");
  TORCH_CHECK(def.arguments.find(" needs_input_grad") == std::string::npos, "torch_opaque: ",
              qual, " has an argument named 'needs_input_grad', which `", def.name,
              "_fwd` uses itself; rename the argument.");
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const char* suffix : {"", "_fwd", "_bwd"}) {
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

  auto lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, def.ns,
                                              std::nullopt, __FILE__, __LINE__);
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  try {
    lib->def(main_schema.c_str(), tags);
    lib->def(fwd_schema.c_str(), tags);
    lib->def(bwd_schema.c_str(), tags);
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
                                std::make_unique<ForwardKernel>(def.forward))));
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
