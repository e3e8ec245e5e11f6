#pragma once
// The `ns::Name_jvp` kernel of a C++ op (Note [C++ jvp]): what runs around
// the user's forward and jvp. Compiled once in csrc/jvp_finisher.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include <string>
#include <vector>

namespace torch_opaque::detail {

// Note [C++ jvp]
// A C++ op whose struct has
//   static std::vector<at::Tensor> jvp(torch_opaque::Context& ctx,
//                                      std::vector<at::Tensor> tangents);
// gets the op `ns::Name_jvp(<arguments>, Tensor?[] tangents) -> (<outputs>,
// Tensor[])`, the one Python Functions with `jvp` get (Note [Forward-mode AD]
// in torch_opaque/_impl/forward_ad.py), so the Autograd kernel's
// forward-mode path (csrc/forward_ad.cpp) serves both. Its kernel runs
// forward without grad on a fresh Context, then jvp on the same Context, whose
// saved_tensors() are now what forward passed to ctx.save_for_forward (as in
// a Python Function) and whose saved_data is forward's. `tangents` has one
// entry per forward argument (undefined for non-tensor arguments and
// arguments without a tangent); jvp returns one tangent per output
// (undefined: zeros). Tensor[] arguments and results are not supported with
// jvp (def<Op> says so at compile time).

// Pops the trailing `Tensor?[] tangents` argument: one tensor per argument,
// undefined for None.
std::vector<at::Tensor> pop_jvp_tangents(torch::jit::Stack* stack);

// Checks the jvp's result against the outputs and pushes the outputs and the
// tangent list (zeros for undefined tangents; copies of outputs that alias an
// input and of tangents that alias an input, an input tangent or an output).
void finish_jvp(const std::string& op_name, c10::ArrayRef<c10::IValue> inputs,
                const std::vector<at::Tensor>& tangents_in, std::vector<at::Tensor> outputs,
                std::vector<at::Tensor> tangents_out, torch::jit::Stack* stack);

} // namespace torch_opaque::detail
