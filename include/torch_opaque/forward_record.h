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

#include <c10/core/SymInt.h>

#include <cstdint>
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

struct ForwardRecord {
  std::vector<SavedRef> saved;
  // One entry per output; empty means "all differentiable".
  std::vector<bool> non_differentiable;
  bool materialize_grads = true;
  std::string state;
  std::vector<c10::SymInt> state_ints;
};

// Called by a forward kernel: takes (and clears) the per-argument
// `needs_input_grad` flags the Autograd kernel set for this call. std::nullopt
// means the call is not being recorded for autograd, and no record is wanted.
std::optional<std::vector<bool>> take_needs_input_grad();

// Called by a forward kernel that was given needs_input_grad flags.
void set_forward_record(ForwardRecord record);

namespace detail {
// Used by the `_fwd` kernel wrapper (Note [needs_input_grad of _fwd]).
void set_needs_input_grad(std::optional<std::vector<bool>> needs);

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
