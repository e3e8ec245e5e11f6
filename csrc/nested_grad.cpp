#include "nested_grad.h"



namespace torch_opaque::detail {
namespace {
thread_local NestedForwardScope* tls_scope = nullptr;
} // namespace

// Note [Nested grad]
// Under nested transforms (grad(grad(f)), jacrev(jacrev(f)), hessian) the
// Autograd kernel of `Name` runs once per grad level, on that level's
// wrappers. It records its node and calls `_fwd`, which functorch sends down
// to the next level: there `_fwd`'s Autograd kernel records a node of its own
// (grad mode is left on for it; a forward runs without grad only at the
// bottom), so the forward is differentiable at every level. The user's forward
// runs once, at the bottom; the record it leaves (Note [Forward record]) is
// taken by the lowest recording level and handed up, level by level, through
// these scopes. Each level passes the union of its own and the level above's
// needs_input_grad down, so the forward saves what every level's backward
// uses. `_bwd` runs the user's backward on the wrappers of its level (Note
// [Double backward]), so its operations record at every level too: the
// backward node calls `_bwd`'s kernel directly (backward_as_user_code), so the
// backward runs as user code of its level does (a stock Function or transform
// it calls sees that level, and its operations record at the level and all
// levels below). The batching rules of `_bwd` run the backward as user code
// too, of the level below theirs (with the dispatch key state functorch saved on
// the level: Note [Batching rules] in _impl/batching.py), so a stock
// autograd.Function it calls (torch.func's custom_function_call, which needs
// functorch's entry key) sees the levels as it would in the user's code. A
// call that still reaches `_bwd`'s Autograd kernel inside a level's
// processing (`Name_bwd` called as an operator there) runs the kernel on that
// level's wrappers with functorch's entry key off (user code cannot re-enter
// the level functorch is processing): a stock Function it calls is refused
// with a clear error.
std::optional<c10::DispatchKeySet> backward_as_user_code(
    const c10::List<std::optional<at::Tensor>>& saved,
    const c10::List<std::optional<at::Tensor>>& grads) {
  constexpr c10::DispatchKeySet batched({c10::DispatchKey::FuncTorchBatched,
                                         c10::DispatchKey::Batched});
  c10::DispatchKeySet keys;
  for (const auto* l : {&saved, &grads}) {
    for (size_t i = 0; i < l->size(); ++i) {
      std::optional<at::Tensor> t = l->get(i);
      if (t.has_value() && t->defined()) keys = keys | t->key_set();
    }
  }
  if (!keys.has(c10::DispatchKey::FuncTorchGradWrapper) || keys.has_any(batched)) {
    return std::nullopt;
  }
  return kernel_keys(keys);
}

c10::DispatchKeySet kernel_keys(c10::DispatchKeySet keys) {
  // The kernel of the tensors' backend, behind the Python and
  // functionalization keys when they are set (fallthrough keys skipped).
  const c10::DispatchKeySet kept = keys & c10::DispatchKeySet({c10::DispatchKey::Python,
                                                             c10::DispatchKey::Functionalize});
  return kept | c10::DispatchKeySet(c10::DispatchKey::Dense) |
      c10::DispatchKeySet(keys.highestBackendKey());
}

NestedForwardScope::NestedForwardScope(const OpaqueOp* op)
    : op_(op), enclosing_(std::exchange(tls_scope, this)) {}

NestedForwardScope::~NestedForwardScope() { tls_scope = enclosing_; }

NestedForwardScope* NestedForwardLink::waiting(const OpaqueOp* op) {
  return tls_scope != nullptr && tls_scope->op_ == op ? tls_scope : nullptr;
}

} // namespace torch_opaque::detail
