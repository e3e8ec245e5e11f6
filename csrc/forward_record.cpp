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
struct EagerSlot {
  const c10::FunctionSchema* schema = nullptr;
  const EagerState* state = nullptr;
};
thread_local EagerSlot tls_eager;
thread_local bool tls_node_takes_record = false;
} // namespace

const EagerState* current_eager_state(const c10::FunctionSchema& bwd_schema) {
  return tls_eager.schema == &bwd_schema ? tls_eager.state : nullptr;
}

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

EagerStateScope::EagerStateScope(const c10::FunctionSchema* bwd_schema,
                                 const EagerState* state)
    : saved_schema_(std::exchange(tls_eager.schema, bwd_schema)),
      saved_state_(std::exchange(tls_eager.state, state)) {}

EagerStateScope::~EagerStateScope() {
  tls_eager.schema = saved_schema_;
  tls_eager.state = saved_state_;
}

NodeTakesRecordScope::NodeTakesRecordScope(bool takes)
    : saved_(std::exchange(tls_node_takes_record, takes)) {}

NodeTakesRecordScope::~NodeTakesRecordScope() { tls_node_takes_record = saved_; }

bool take_node_takes_record() { return std::exchange(tls_node_takes_record, false); }

ForwardRecord* pending_forward_record() {
  return tls_call.record ? &*tls_call.record : nullptr;
}

std::optional<ForwardRecord> ForwardCallScope::take_record() {
  return std::exchange(tls_call.record, std::nullopt);
}
} // namespace detail
} // namespace torch_opaque
