#pragma once
// In-place ops (Note [In-place ops] in csrc/in_place.cpp): an op whose
// definition lists `dirty` pairs takes those arguments as `Tensor(a!)` and
// writes the forward's results into them.

#include <torch_opaque/opaque_op.h>

#include <ATen/core/function_schema.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <vector>

namespace torch_opaque::detail {

// The schema of `ns::Name` for an in-place definition: `functional` (the
// arguments and all outputs) with each dirty argument annotated `Tensor(a!)`
// (b!, c!, ...) and without the dirty outputs.
c10::FunctionSchema in_place_schema(const c10::FunctionSchema& functional,
                                    const OpDefinition& def);

// The argument a `_fwd` output is written into, if it is a dirty output.
std::optional<size_t> dirty_argument(const OpDefinition& def, size_t output);

// The dirty arguments of the call whose `n_args` arguments end the stack.
std::vector<at::Tensor> dirty_arguments(const OpDefinition& def, const torch::jit::Stack& stack,
                                        size_t n_args);

// After the forward left its `n_out` outputs on the stack: copies each dirty
// output into its argument (`args`, from dirty_arguments), bumping the
// argument's version counter, and removes the output.
void write_back(const OpDefinition& def, const std::vector<at::Tensor>& args,
                torch::jit::Stack* stack, size_t n_out);

// Before a differentiable call modifies `args`: autograd's checks of an
// in-place autograd.Function (a leaf requiring grad, views it cannot rebase).
void check_in_place(const OpDefinition& def, const std::vector<at::Tensor>& args,
                    size_t n_out);

} // namespace torch_opaque::detail

namespace torch::autograd {
struct Node;
}

namespace torch_opaque::detail {

// The Autograd kernel's step for output k of a graph-building call: when k is
// a dirty output, copies it into its argument, which replaces it in
// `outputs` and has its history rebased onto `node` (Note [In-place ops]);
// false for other outputs.
bool rebase_dirty_output(const OpDefinition& def, const std::vector<at::Tensor>& args, size_t k,
                         c10::SmallVectorImpl<at::Tensor>& outputs,
                         const c10::intrusive_ptr<torch::autograd::Node>& node);

} // namespace torch_opaque::detail
