#include <torch_opaque/forward_record.h>

#include <c10/util/Exception.h>

#include <utility>

namespace torch_opaque {
namespace {
struct ForwardCallState {
  std::optional<std::vector<bool>> needs_input_grad;
  std::optional<ForwardRecord> record;
};
thread_local ForwardCallState tls_call;
} // namespace

std::optional<std::vector<bool>> take_needs_input_grad() {
  return std::exchange(tls_call.needs_input_grad, std::nullopt);
}

namespace detail {
void set_needs_input_grad(std::optional<std::vector<bool>> needs) {
  tls_call.needs_input_grad = std::move(needs);
}
} // namespace detail

void set_forward_record(ForwardRecord record) {
  tls_call.record = std::move(record);
}

namespace detail {
ForwardCallScope::ForwardCallScope(std::optional<std::vector<bool>> needs)
    : saved_needs_(std::exchange(tls_call.needs_input_grad, std::move(needs))),
      saved_record_(std::exchange(tls_call.record, std::nullopt)) {}

ForwardCallScope::~ForwardCallScope() {
  tls_call.needs_input_grad = std::move(saved_needs_);
  tls_call.record = std::move(saved_record_);
}

std::optional<ForwardRecord> ForwardCallScope::take_record() {
  return std::exchange(tls_call.record, std::nullopt);
}
} // namespace detail
} // namespace torch_opaque
