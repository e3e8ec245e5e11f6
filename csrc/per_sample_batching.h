#pragma once
// vmap of C++ ops: one boxed FuncTorchBatched kernel for `Name`, `Name_fwd`,
// `Name_bwd` and `Name_jvp` (Note [Per-sample batching] in
// per_sample_batching.cpp).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch_opaque/opaque_op.h>

namespace torch_opaque::detail {

void per_sample_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// `ns::Name`'s kernel for an op with an author-written batched forward `fn`
// (OpDefinition::batched_forward, a C++ op's `vmap`): every tensor argument
// gets the batch as its first dimension (expanded where it has none), `fn`
// runs once, and its outputs (batch first) are batched. Calls whose tensors
// require grad under plain autograd run per sample instead.
void batched_forward_kernel(const BoxedKernel& fn, const c10::OperatorHandle& op,
                            torch::jit::Stack* stack);

} // namespace torch_opaque::detail
