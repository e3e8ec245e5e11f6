// Note [Data-dependent sizes] and Note [Debug mode]
// (include/torch_opaque/fake_checks.h).
#include <torch_opaque/fake_checks.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace torch_opaque {
namespace {

bool debug_from_env() {
  const char* v = std::getenv("TORCH_OPAQUE_DEBUG");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

std::atomic<bool>& debug_flag() {
  static std::atomic<bool> flag(debug_from_env());
  return flag;
}

std::atomic<detail::DynamicSizeHook> g_hook{nullptr};
thread_local bool tls_in_check = false;

} // namespace

void set_debug(bool on) { debug_flag().store(on); }
bool debug_enabled() { return debug_flag().load(std::memory_order_relaxed); }

namespace detail {

void set_dynamic_size_hook(DynamicSizeHook hook) { g_hook.store(hook); }

c10::SymInt new_dynamic_size(int64_t min, std::optional<int64_t> max) {
  if (tls_in_check) throw DynamicSizeInCheck{};
  TORCH_CHECK(min >= 0, "torch_opaque: ctx.new_dynamic_size(min=", min,
              "): a size cannot be negative.");
  TORCH_CHECK(!max.has_value() || *max >= min, "torch_opaque: ctx.new_dynamic_size(min=", min,
              ", max=", *max, "): max is below min.");
  DynamicSizeHook hook = g_hook.load();
  TORCH_CHECK(hook != nullptr,
              "torch_opaque: ctx.new_dynamic_size() creates a data-dependent size while "
              "torch.export or torch.compile traces the op with fake tensors; it needs the "
              "torch_opaque Python module (import torch_opaque), and is only meaningful in a "
              "`fake`. A forward knows its sizes: use the real ones there.");
  return hook(min, max);
}

FakeCheckScope::FakeCheckScope() : saved_(tls_in_check) { tls_in_check = true; }
FakeCheckScope::~FakeCheckScope() { tls_in_check = saved_; }

} // namespace detail
} // namespace torch_opaque
