// Note [Autocast in the call: C++ ops]
// What Note [Autocast in the call] (torch_opaque/_impl/autocast_variant.py)
// does for Python Functions, for ops defined in C++ with def<Op> /
// TORCH_OPAQUE_DEF. In eager code a C++ op's forward runs where its call
// runs, inside the caller's torch.autocast block, so its ATen calls autocast
// (at::matmul gives bfloat16 under autocast("cpu", torch.bfloat16)). A traced
// program (run_decompositions, ep.module() after it, torch.compile with
// aot_eager or inductor) applies autocast while it is traced and runs without
// it: the op's kernel then ran in its inputs' dtypes and silently returned
// float32. So the state goes into the call, as for Python Functions:
//
// * def<Op> defines, next to `ns::Name`, the variant family
//   `ns::Name_autocast(<arguments>, str autocast_state="")` with its own
//   `_fwd` / `_bwd` (and Meta kernels, when Op has a fake). Its forward
//   enters the state (at::autocast's thread-local state: enabled and dtype
//   for each device, the nesting count, as torch.autocast's __enter__ does)
//   around the user's forward; its backward is the base's (without autocast,
//   as a stock Function's backward runs) with no gradient for the string.
//   The string has the Python front end's format: "cpu:torch.bfloat16",
//   ';'-separated for several devices; it is parsed with a closed table of
//   dtype names, and anything else is a c10::Error naming the variant.
// * `ns::Name` gets a kernel at each Autocast key (AutocastCPU, AutocastCUDA
//   and the others). It runs only while autocast is on for a device of the
//   call's tensors (at run time in eager code, at trace time in traced code,
//   where the autocast block is entered while tracing; the Python dispatcher
//   reaches the C++ kernel through resolve_key, as it finds any kernel the
//   op has at that key). With the Autocast keys excluded it calls the variant
//   with the state appended, or, when autocast is on for none of the call's
//   devices, `ns::Name` itself. Entering the state inside the variant turns
//   the device's Autocast key back on (at::autocast::set_autocast_enabled).
//   Traced graphs hold the variant's node, state included: one opaque node
//   per call, with the dtypes of eager code.
// * The variant has no Autocast kernel of its own; it keeps the base's jvp
//   (run under the state, without the state's tangent) and per-sample
//   batching, so forward-mode AD and vmap under autocast work as in eager code.
//   Archives call the variant by name: it exists once the library is loaded.
// * Debug mode (Note [Debug mode] in fake_checks.h) does not compare a fake
//   with a forward that runs under autocast (runs_under_autocast): its meta
//   copies have no Autocast key, so the fake would give the inputs' dtypes
//   (bfloat16 forward, float32 fake) and the check would blame a right fake.
//   Ops defined from Python (define_op without def<Op>) get nothing here:
//   the Python front end registers its own Autocast kernels.
#include <torch_opaque/detail/autocast_variant.h>
#include <torch_opaque/detail/finishers.h>
#include <torch_opaque/forward_record.h>

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <sstream>
#include <utility>

namespace torch_opaque::detail {

const char* const kAutocastSuffix = "_autocast";

namespace {

// The dtypes autocast computes in, by the names str(torch.dtype) gives.
constexpr std::array<std::pair<const char*, at::ScalarType>, 4> kDtypes{{
    {"torch.float16", at::kHalf},
    {"torch.bfloat16", at::kBFloat16},
    {"torch.float32", at::kFloat},
    {"torch.float64", at::kDouble},
}};

// The devices autocast knows (at::autocast's list), as Python names them.
constexpr std::array<c10::DeviceType, 10> kDevices{
    c10::DeviceType::CPU, c10::DeviceType::CUDA, c10::DeviceType::MTIA,
    c10::DeviceType::MAIA, c10::DeviceType::XPU, c10::DeviceType::IPU,
    c10::DeviceType::HPU, c10::DeviceType::XLA, c10::DeviceType::MPS,
    c10::DeviceType::PrivateUse1};

std::string device_name(c10::DeviceType d) { return c10::DeviceTypeName(d, /*lower_case=*/true); }

bool autocast_device(c10::DeviceType d) {
  return std::find(kDevices.begin(), kDevices.end(), d) != kDevices.end() &&
         at::autocast::is_autocast_available(d);
}

std::string dtype_names() {
  std::string s;
  for (const auto& [name, _] : kDtypes) s += (s.empty() ? "" : ", ") + std::string(name);
  return s;
}

// at::autocast's state for the entries, entered as torch.autocast's
// __enter__ does and left as its __exit__ does.
class EnteredAutocast {
 public:
  explicit EnteredAutocast(const std::vector<AutocastEntry>& entries) {
    prev_.reserve(entries.size());
    for (const AutocastEntry& e : entries) {
      prev_.push_back({e.device, at::autocast::is_autocast_enabled(e.device),
                       at::autocast::get_autocast_dtype(e.device)});
      at::autocast::set_autocast_enabled(e.device, true);
      at::autocast::set_autocast_dtype(e.device, e.dtype);
      at::autocast::increment_nesting();
    }
  }
  ~EnteredAutocast() {
    for (auto it = prev_.rbegin(); it != prev_.rend(); ++it) {
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      at::autocast::set_autocast_enabled(it->device, it->enabled);
      at::autocast::set_autocast_dtype(it->device, it->dtype);
    }
  }
  EnteredAutocast(const EnteredAutocast&) = delete;
  EnteredAutocast& operator=(const EnteredAutocast&) = delete;

 private:
  struct Prev {
    c10::DeviceType device;
    bool enabled;
    at::ScalarType dtype;
  };
  std::vector<Prev> prev_;
};

// A forward-like kernel of the variant: pops the state (the last argument),
// drops its needs_input_grad flag, runs the base's kernel under the state.
BoxedKernel with_state(BoxedKernel base, std::string variant_name) {
  return [base = std::move(base), variant_name = std::move(variant_name)](
             const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
    const std::vector<AutocastEntry> entries =
        parse_autocast_state(stack->back().toStringRef(), variant_name);
    stack->pop_back();
    std::optional<std::vector<bool>> needs = take_needs_input_grad();
    if (needs && !needs->empty()) needs->pop_back();  // the state's flag
    set_needs_input_grad(std::move(needs));
    EnteredAutocast entered(entries);
    base(schema, stack);
  };
}

// The variant's `_jvp` kernel: the base's under the state, without the
// state's tangent (the stack ends with the state, then the tangents).
BoxedKernel jvp_with_state(BoxedKernel base, std::string variant_name) {
  return [base = std::move(base), variant_name = std::move(variant_name)](
             const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
    c10::List<std::optional<at::Tensor>> tangents = stack->back().toOptionalTensorList();
    stack->pop_back();
    const std::vector<AutocastEntry> entries =
        parse_autocast_state(stack->back().toStringRef(), variant_name);
    stack->pop_back();
    c10::List<std::optional<at::Tensor>> without_state;
    for (size_t i = 0; i + 1 < tangents.size(); ++i) without_state.push_back(tangents.get(i));
    stack->emplace_back(std::move(without_state));
    EnteredAutocast entered(entries);
    base(schema, stack);
  };
}

// The variant's backward: the base's, without autocast, and no gradient for
// the state.
DirectBackward without_state_gradient(DirectBackward base) {
  return [base = std::move(base)](BackwardArgs args,
                                  const EagerState* eager) -> std::vector<at::Tensor> {
    if (!args.needs_input_grad.empty()) args.needs_input_grad.pop_back();
    std::vector<at::Tensor> grads = base(std::move(args), eager);
    grads.emplace_back();
    return grads;
  };
}

// `ns::Name` at the Autocast keys.
class AutocastKernel final : public c10::OperatorKernel {
 public:
  AutocastKernel(std::string variant_name, std::string overload)
      : variant_name_(std::move(variant_name)), overload_(std::move(overload)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    std::optional<std::string> state = autocast_state_of_call(torch::jit::last(*stack, n));
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    if (!state) {  // autocast on, but for none of the call's devices
      op.callBoxed(stack);
      return;
    }
    stack->emplace_back(std::move(*state));
    variant().callBoxed(stack);
  }

 private:
  const c10::OperatorHandle& variant() {
    std::call_once(found_, [&] {
      variant_ = c10::Dispatcher::singleton().findSchemaOrThrow(variant_name_.c_str(),
                                                                overload_.c_str());
    });
    return *variant_;
  }
  std::string variant_name_, overload_;
  std::once_flag found_;
  std::optional<c10::OperatorHandle> variant_;
};

std::vector<std::unique_ptr<torch::Library>>& autocast_libraries() {
  // Kept for the process, as define_op keeps its registrations (C++ ops are
  // never released).
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
  return *libs;
}

std::mutex& libraries_mutex() {
  static std::mutex mu;
  return mu;
}

} // namespace

std::vector<AutocastEntry> parse_autocast_state(const std::string& state,
                                                const std::string& op_name) {
  std::vector<AutocastEntry> entries;
  std::istringstream parts(state);
  std::string part;
  while (std::getline(parts, part, ';')) {
    if (part.empty()) continue;
    const auto colon = part.find(':');
    const std::string device = part.substr(0, colon);
    const std::string dtype = colon == std::string::npos ? "" : part.substr(colon + 1);
    std::optional<c10::DeviceType> d;
    for (c10::DeviceType k : kDevices) {
      if (autocast_device(k) && device_name(k) == device) d = k;
    }
    std::optional<at::ScalarType> t;
    for (const auto& [name, type] : kDtypes) {
      if (dtype == name) t = type;
    }
    TORCH_CHECK(d && t, "torch_opaque: ", op_name, ": autocast state '", state,
                "' is not '<device type>:<dtype>' of a device autocast knows (as in "
                "'cpu:torch.bfloat16', ';'-separated; dtypes: ", dtype_names(),
                "). Pass the state the op's Autocast kernel records, or call the op without "
                "the '", kAutocastSuffix, "' suffix under torch.autocast.");
    entries.push_back({*d, *t});
  }
  return entries;
}

std::optional<std::string> autocast_state_of_call(c10::ArrayRef<c10::IValue> args) {
  std::vector<c10::DeviceType> devices;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    const c10::DeviceType d = t.device().type();
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  };
  for (const c10::IValue& v : args) {
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) add(t);
    } else if (v.isList()) {  // Tensor?[]
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) add(e.toTensor());
      }
    }
  }
  std::vector<std::pair<std::string, c10::DeviceType>> named;
  for (c10::DeviceType d : devices) {
    if (autocast_device(d) && at::autocast::is_autocast_enabled(d)) {
      named.emplace_back(device_name(d), d);
    }
  }
  if (named.empty()) return std::nullopt;
  std::sort(named.begin(), named.end());
  std::string state;
  for (const auto& [name, d] : named) {
    const at::ScalarType dtype = at::autocast::get_autocast_dtype(d);
    auto it = std::find_if(kDtypes.begin(), kDtypes.end(),
                           [&](const auto& e) { return e.second == dtype; });
    TORCH_CHECK(it != kDtypes.end(), "torch_opaque: autocast on ", name, " computes in ",
                dtype, ", which opaque ops do not record (they know ", dtype_names(),
                "). Use one of those dtypes in torch.autocast.");
    state += (state.empty() ? "" : ";") + name + ":" + it->first;
  }
  return state;
}

bool runs_under_autocast(const c10::FunctionSchema& fwd_schema, c10::ArrayRef<c10::IValue> args) {
  const auto& params = fwd_schema.arguments();  // ..., autocast_state, needs_input_grad
  if (!args.empty() && params.size() == args.size() + 1 &&
      params[args.size() - 1].name() == "autocast_state" && args.back().isString() &&
      !args.back().toStringRef().empty()) {
    return true;
  }
  auto on = [](const at::Tensor& t) {
    return t.defined() && autocast_device(t.device().type()) &&
           at::autocast::is_autocast_enabled(t.device().type());
  };
  for (const c10::IValue& v : args) {
    if (v.isTensor() && on(v.toTensor())) return true;
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (on(t)) return true;
      }
    }
  }
  return false;
}

std::shared_ptr<OpaqueOp> define_autocast_variant(const std::shared_ptr<OpaqueOp>& base) {
  const OpDefinition& b = base->definition();
  TORCH_INTERNAL_ASSERT(b.dirty.empty() && b.direct_backward,
                        "autocast variants are defined for def<Op> ops");
  OpDefinition v;
  v.ns = b.ns;
  v.name = b.name + kAutocastSuffix;
  v.overload = b.overload;
  v.arguments = b.arguments + (b.arguments.empty() ? "" : ", ") + "str autocast_state=\"\"";
  v.returns = b.returns;
  const std::string variant_name =
      v.ns + "::" + v.name + (v.overload.empty() ? "" : "." + v.overload);
  v.forward = with_state(b.forward, variant_name);
  v.direct_backward = without_state_gradient(b.direct_backward);
  if (b.meta_forward) v.meta_forward = with_state(b.meta_forward, variant_name);
  if (b.batched_forward) v.batched_forward = with_state(b.batched_forward, variant_name);
  if (b.jvp) v.jvp = jvp_with_state(b.jvp, variant_name);
  v.per_sample_batching = b.per_sample_batching;
  v.differentiate_lists = b.differentiate_lists;
  std::shared_ptr<OpaqueOp> variant;
  try {
    variant = define_op(std::move(v));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "torch_opaque: ", base->qualified_name(),
                " is defined, but not its autocast variant ", variant_name,
                " (Note [Autocast in the call: C++ ops]), so the op would not follow "
                "torch.autocast in traced programs. Rename the op (or the other op named ",
                variant_name, "). ", e.what_without_backtrace());
  }
  auto lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, b.ns, std::nullopt,
                                              __FILE__, __LINE__);
  const std::string main_name = b.name + (b.overload.empty() ? "" : "." + b.overload);
  for (c10::DispatchKey key : c10::autocast_dispatch_keyset) {
    lib->impl(main_name.c_str(),
              torch::dispatch(key, torch::CppFunction::makeFromBoxedFunctor(
                                       std::make_unique<AutocastKernel>(
                                           b.ns + "::" + b.name + kAutocastSuffix, b.overload))));
  }
  std::lock_guard<std::mutex> lock(libraries_mutex());
  autocast_libraries().push_back(std::move(lib));
  return variant;
}

} // namespace torch_opaque::detail
