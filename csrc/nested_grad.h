#pragma once
// Nested torch.func.grad through an opaque op (Note [Nested grad]).

#include <torch_opaque/forward_record.h>
#include <torch_opaque/opaque_op.h>

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>

#include <optional>

namespace torch_opaque::detail {

// Whether an Autograd kernel runs inside a torch.func grad/vjp/jvp transform
// level (functorch leaves its back-mode key included while a level runs).
inline bool under_functorch_level(c10::DispatchKeySet keys) {
  return keys.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

// The dispatch keys that take a `_bwd` call straight to its kernel, run as
// user code of the current transform level: when the backward's tensors are
// grad wrappers of a torch.func level (and none is batched: batched calls
// take the op's batching rule). nullopt otherwise.
std::optional<c10::DispatchKeySet> backward_as_user_code(
    const c10::List<std::optional<at::Tensor>>& saved,
    const c10::List<std::optional<at::Tensor>>& grads);

// The dispatch keys that take a call of `_bwd` with dispatch keys `keys`
// straight to its kernel (behind the Python and functionalization keys).
c10::DispatchKeySet kernel_keys(c10::DispatchKeySet keys);

// Opened by the Autograd kernel of `Name` (or `Name_fwd`) of a level around
// its `_fwd` call: the `_fwd` Autograd kernel of the next level down, which
// takes the forward record first, hands a copy up to it.
class NestedForwardScope {
 public:
  explicit NestedForwardScope(const OpaqueOp* op);
  ~NestedForwardScope();
  NestedForwardScope(const NestedForwardScope&) = delete;
  NestedForwardScope& operator=(const NestedForwardScope&) = delete;
  // The record the level below handed up, if any.
  std::optional<ForwardRecord> take() { return std::exchange(record_, std::nullopt); }

 private:
  const OpaqueOp* op_;
  std::optional<ForwardRecord> record_;
  NestedForwardScope* enclosing_;
  friend class NestedForwardLink;
};

// Used by a `_fwd` Autograd kernel: whether a level above waits for this
// op's forward record, and handing it a copy.
class NestedForwardLink {
 public:
  // The scope of the level directly above, when it belongs to `op`.
  static NestedForwardScope* waiting(const OpaqueOp* op);
  static void hand_up(NestedForwardScope* scope, const ForwardRecord& record) {
    scope->record_ = record;
  }
};

} // namespace torch_opaque::detail
