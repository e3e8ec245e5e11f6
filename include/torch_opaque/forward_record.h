#pragma once
// What a forward kernel tells the generic Autograd kernel about one call.
//
// Note [Forward record]
// An opaque op `ns::Name` has a companion `ns::Name_fwd` that returns the
// op's outputs followed by a list of residual tensors, and `ns::Name_bwd` that
// turns saved tensors and output gradients into input gradients. The tensors
// are schema values, so they appear in traced training graphs. Everything else
// the backward needs (which tensors were saved and where they came from, which
// outputs are non-differentiable, whether undefined gradients are
// materialized, and non-tensor context state) travels in a ForwardRecord: the
// forward kernel hands it over through a thread-local slot that the Autograd
// kernel empties right after the `_fwd` call returns. The non-tensor context
// state becomes the `str state` and `SymInt[] state_ints` arguments of
// `ns::Name_bwd`, so a traced backward carries it as constants and symbols.

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <c10/core/SymInt.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_opaque {

// Where a saved tensor comes from.
enum class SavedKind : int64_t {
  None = 0,          // ctx.save_for_backward(None)
  Input = 1,         // argument `index` (a Tensor or Tensor? argument)
  InputListItem = 2, // element `item` of argument `index` (a Tensor[] argument)
  Output = 3,        // output `index`
  Residual = 4,      // element `index` of the `_fwd` op's residual list
};

struct SavedRef {
  SavedKind kind = SavedKind::None;
  int64_t index = 0;
  int64_t item = 0;
};

// Note [Eager context state]
// A forward written in another language (the Python bridge) may keep its
// non-tensor context state as that language's objects instead of encoding
// it into `state`: eager calls then hand the backward exactly what the
// forward stored, at no encoding cost. The backward node owns the object and
// passes it to the `_bwd` kernel through a thread-local slot
// (current_eager_state) when it calls `_bwd` on plain tensors with no
// dispatch mode active; when the backward is being traced (fake or
// functional tensors, a Python dispatch mode), it calls encode() instead, so
// the traced graph carries the state as `_bwd` arguments.
class EagerState {
 public:
  virtual ~EagerState() = default;
  // The state as `_bwd` arguments. `saved` holds the saved tensors; tensors
  // the state holds are appended to it.
  virtual void encode(std::string& state, std::vector<c10::SymInt>& state_ints,
                      std::vector<at::Tensor>& saved) const = 0;
};

struct ForwardRecord {
  std::vector<SavedRef> saved;
  // One entry per output; empty means "all differentiable".
  std::vector<bool> non_differentiable;
  bool materialize_grads = true;
  std::string state;
  std::vector<c10::SymInt> state_ints;
  // Set instead of `state` by forwards that keep their state as objects.
  std::shared_ptr<const EagerState> eager_state;
};

// Called by a forward kernel: takes (and clears) the per-argument
// `needs_input_grad` flags the Autograd kernel set for this call. std::nullopt
// means the call is not being recorded for autograd, and no record is wanted.
std::optional<std::vector<bool>> take_needs_input_grad();

// Called by a forward kernel that was given needs_input_grad flags.
void set_forward_record(ForwardRecord record);

// Called by a `_bwd` kernel: the eager state its node passed for this call
// (nullptr when there is none: the state is in the `state` argument).
// `bwd_schema` is the schema the kernel was called for (the slot belongs to
// one `_bwd` op).
const EagerState* current_eager_state(const c10::FunctionSchema& bwd_schema);

namespace detail {
// Used by the backward node around a `_bwd` call (Note [Eager context state]).
class EagerStateScope {
 public:
  EagerStateScope(const c10::FunctionSchema* bwd_schema, const EagerState* state);
  ~EagerStateScope();
  EagerStateScope(const EagerStateScope&) = delete;
  EagerStateScope& operator=(const EagerStateScope&) = delete;

 private:
  const c10::FunctionSchema* saved_schema_;
  const EagerState* saved_state_;
};

// Used by the `_fwd` kernel wrapper (Note [needs_input_grad of _fwd]).
void set_needs_input_grad(std::optional<std::vector<bool>> needs);

// Note [Eager state is for nodes]
// A forward may keep its ctx state as objects (Note [Eager context state])
// only when a backward node built by the Autograd kernel takes its record.
// A `_fwd` call that records for a graph (a compiled forward calling `_fwd`
// with grad mode off, with needs_input_grad from the graph) must return the
// residuals its fake returned when the graph was traced, which encodes the
// state: its tensors are residuals there. The Autograd kernel says which by
// this flag, which the forward kernel reads once (take_node_takes_record), so
// calls nested inside the forward see false.
class NodeTakesRecordScope {
 public:
  explicit NodeTakesRecordScope(bool takes);
  ~NodeTakesRecordScope();
  NodeTakesRecordScope(const NodeTakesRecordScope&) = delete;
  NodeTakesRecordScope& operator=(const NodeTakesRecordScope&) = delete;

 private:
  bool saved_;
};
// Read by a forward kernel: whether a node takes its record (and clears it).
bool take_node_takes_record();

// The record a forward kernel set on this thread that the Autograd kernel
// around it has not taken yet, or nullptr: a layer between the two (the
// DTensor handler of `_fwd`, Note [Sharding opaque ops] in
// torch_opaque/integrations/sharding.py) points its saved tensors at what it made.
ForwardRecord* pending_forward_record();

// Used by the Autograd kernel around a `_fwd` call.
class ForwardCallScope {
 public:
  explicit ForwardCallScope(std::optional<std::vector<bool>> needs_input_grad);
  ~ForwardCallScope();
  ForwardCallScope(const ForwardCallScope&) = delete;
  ForwardCallScope& operator=(const ForwardCallScope&) = delete;
  // The record the forward kernel set, if any.
  std::optional<ForwardRecord> take_record();

 private:
  std::optional<std::vector<bool>> saved_needs_;
  std::optional<ForwardRecord> saved_record_;
};
} // namespace detail

} // namespace torch_opaque
