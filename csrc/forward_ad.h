#pragma once
// Forward-mode AD through an opaque op (Note [Forward-mode AD] in
// torch_opaque/_impl/forward_ad.py): the Autograd kernel's path for arguments
// that carry forward gradients.

#include <torch_opaque/opaque_op.h>

#include <ATen/core/stack.h>

#include <functional>

namespace torch_opaque::detail {

// Whether a top-level tensor argument of the op's call carries a forward
// gradient (a dual tensor of torch.autograd.forward_ad, torch.func.jvp).
bool has_forward_grads(const torch::jit::Stack& stack, size_t n_args);

// Runs the call with forward gradients: the outputs and their tangents come
// from `ns::Name_jvp`; when reverse mode is needed too, the outputs come from
// `reverse` (which records the backward) and `Name_jvp` gives the tangents.
// An op without `Name_jvp` raises torch's error for a Function without jvp.
// `n_extra`: results `reverse` leaves after the outputs (`_fwd`'s residuals);
// then the outputs always come from `reverse`.
void run_with_forward_grads(const OpaqueOp& op, torch::jit::Stack* stack,
                            const std::function<void(torch::jit::Stack*)>& reverse,
                            size_t n_extra = 0);

} // namespace torch_opaque::detail
