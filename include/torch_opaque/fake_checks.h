#pragma once
// Data-dependent output sizes in a C++ op's `fake`, and the debug-mode check
// of a forward's outputs against its fake's.
//
// Note [Data-dependent sizes]
// A `fake` computes output metadata without data, so an output whose size
// depends on the data (masked_select, nonzero, unique) cannot be computed by
// running the forward on meta tensors. The fake calls
// ctx.new_dynamic_size(min, max) instead: while torch.export or
// torch.compile traces with fake tensors it returns a new unbacked SymInt
// (torch.library.get_ctx().new_dynamic_size(), reached through a hook the
// Python module installs); anywhere else it raises, naming the reason.
//
// Note [Debug mode]
// set_debug(true) (or TORCH_OPAQUE_DEBUG=1 in the environment, or
// torch_opaque.set_debug(True)) makes each eager call of an op that has a
// `fake` also run the fake on meta copies of its inputs and compare output
// shapes and dtypes: a fake that guesses a size (an upper bound, say) fails
// loudly instead of exporting a program that computes wrong numbers. Calls
// whose fake creates dynamic sizes are not compared (there is nothing to
// compare a fresh size with).

#include <c10/core/SymInt.h>

#include <cstdint>
#include <optional>

namespace torch_opaque {

void set_debug(bool on);
bool debug_enabled();

namespace detail {

// Installed by the Python module: a new unbacked size of the current fake
// tracing context.
using DynamicSizeHook = c10::SymInt (*)(int64_t min, std::optional<int64_t> max);
void set_dynamic_size_hook(DynamicSizeHook hook);

// What Context::new_dynamic_size calls.
c10::SymInt new_dynamic_size(int64_t min, std::optional<int64_t> max);

// Thrown by new_dynamic_size while the debug check runs a fake: the check is
// skipped for that call.
struct DynamicSizeInCheck {};

// Set while the debug check runs a fake.
class FakeCheckScope {
 public:
  FakeCheckScope();
  ~FakeCheckScope();
  FakeCheckScope(const FakeCheckScope&) = delete;
  FakeCheckScope& operator=(const FakeCheckScope&) = delete;

 private:
  bool saved_;
};

} // namespace detail
} // namespace torch_opaque
