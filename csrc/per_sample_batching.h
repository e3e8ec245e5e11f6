#pragma once
// vmap of C++ ops: one boxed FuncTorchBatched kernel for `Name`, `Name_fwd`,
// `Name_bwd` and `Name_jvp` (Note [Per-sample batching] in
// per_sample_batching.cpp).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace torch_opaque::detail {

void per_sample_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace torch_opaque::detail
