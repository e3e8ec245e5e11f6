#include "in_place.h"

#include <ATen/core/alias_info.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <string>

namespace torch_opaque::detail {

// Note [In-place ops]
// A forward that modifies arguments in place (autograd.Function's
// ctx.mark_dirty) is an op with a mutable schema, as torch.library makes one
// for `mutates_args`: `ns::Name(Tensor(a!) x, ...) -> (other outputs)`.
// Calling it modifies x, so torch.export and torch.compile functionalize it
// (auto_functionalized_v2) like any custom op that mutates its arguments.
// `ns::Name_fwd` stays functional: it returns the new values of the dirty
// arguments as outputs (the front end runs the user's forward on copies),
// so training graphs and the backward see an ordinary op. The kernels of
// `ns::Name` write them back:
// - below autograd (InferenceKernel) with `x.copy_(new)`;
// - both bump x's version counter as autograd.Function does (bump_as_stock);
// - when a graph is built, the Autograd kernel first runs autograd.Function's
//   checks (a leaf that requires grad, a view with more than one output),
//   then calls `_fwd`, copies the result into x and rebases x's history onto
//   the backward node (views get CopySlices), as autograd.Function does for
//   dirty tensors.

namespace {
// Bumps `arg`'s version counter as autograd.Function does for a dirty tensor:
// once per in-place operation the forward ran on it (counted on `out`, the
// fresh copy the forward modified), and once for ctx.mark_dirty.
void bump_as_stock(const at::Tensor& arg, const at::Tensor& out) {
  if (arg.is_inference()) return;
  const uint32_t writes = out.is_inference()
      ? 0 : torch::autograd::impl::version_counter(out).current_version();
  for (uint32_t i = 0; i <= writes; ++i) torch::autograd::increment_version(arg);
}
} // namespace

c10::FunctionSchema in_place_schema(const c10::FunctionSchema& functional,
                                    const OpDefinition& def) {
  std::vector<c10::Argument> args = functional.arguments();
  char set = 'a';
  for (const auto& [k, i] : def.dirty) {
    TORCH_CHECK(i < args.size() && args[i].type()->kind() == c10::TypeKind::TensorType,
                "torch_opaque: ", def.name, ": dirty argument ", i, " is not a Tensor argument.");
    c10::AliasInfo alias;
    const auto symbol = c10::Symbol::fromQualString(std::string("alias::") + set++);
    alias.addBeforeSet(symbol);
    alias.addAfterSet(symbol);  // as the parser reads `Tensor(a!)`
    alias.setIsWrite(true);
    const c10::Argument& a = args[i];
    args[i] = c10::Argument(a.name(), a.type(), a.real_type(), a.N(), a.default_value(),
                            a.kwarg_only(), std::move(alias));
  }
  std::vector<c10::Argument> returns;
  for (size_t k = 0; k < functional.returns().size(); ++k) {
    if (!dirty_argument(def, k)) returns.push_back(functional.returns()[k]);
  }
  c10::FunctionSchema out =
      functional.cloneWithArguments(std::move(args)).cloneWithReturns(std::move(returns));
  out.setAliasAnalysis(c10::AliasAnalysisKind::FROM_SCHEMA);
  return out;
}

std::optional<size_t> dirty_argument(const OpDefinition& def, size_t output) {
  for (const auto& [k, i] : def.dirty) {
    if (k == output) return i;
  }
  return std::nullopt;
}

std::vector<at::Tensor> dirty_arguments(const OpDefinition& def, const torch::jit::Stack& stack,
                                        size_t n_args) {
  std::vector<at::Tensor> out;
  out.reserve(def.dirty.size());
  auto args = torch::jit::last(stack, n_args);
  for (const auto& [k, i] : def.dirty) out.push_back(args[i].toTensor());
  return out;
}

void write_back(const OpDefinition& def, const std::vector<at::Tensor>& args,
                torch::jit::Stack* stack, size_t n_out) {
  const auto first = stack->end() - n_out;
  for (size_t d = 0; d < def.dirty.size(); ++d) {
    const at::Tensor& out = (first + def.dirty[d].first)->toTensor();
    args[d].copy_(out);
    bump_as_stock(args[d], out);
  }
  // Erase from the back so the indices of earlier outputs stay valid.
  for (size_t k = n_out; k-- > 0;) {
    if (dirty_argument(def, k)) stack->erase(first + k);
  }
}

void check_in_place(const OpDefinition& def, const std::vector<at::Tensor>& args,
                    size_t n_out) {
  for (const at::Tensor& t : args) {
    // autograd.Function's own messages for a dirty tensor.
    TORCH_CHECK(!t.is_leaf() || !t.requires_grad(),
                "a leaf Variable that requires grad has been used in an in-place operation.");
    TORCH_CHECK(
        !(t.is_view() && n_out > 1),
        "If your Function modifies inplace an input that is a view of another Tensor, your "
        "Function cannot return more than one Tensor. This is not supported by the current "
        "autograd engine. You should either make sure the input is not a view (using .clone() "
        "for example) or make your Function only return one Tensor (potentially splitting it "
        "into two Functions: one doing the inplace that returns a single Tensor and a second "
        "one that does the other operations). You can ask on the forum "
        "https://discuss.pytorch.org/ if you need help to do so.");
    torch::autograd::check_inplace(t, /*requires_grad=*/true);
  }
}


bool rebase_dirty_output(const OpDefinition& def, const std::vector<at::Tensor>& args, size_t k,
                         c10::SmallVectorImpl<at::Tensor>& outputs,
                         const c10::intrusive_ptr<torch::autograd::Node>& node) {
  for (size_t d = 0; d < def.dirty.size(); ++d) {
    if (def.dirty[d].first != k) continue;
    const at::Tensor& arg = args[d];
    {
      at::AutoDispatchBelowADInplaceOrView below;  // the write is not differentiated
      arg.copy_(outputs[k]);
    }
    bump_as_stock(arg, outputs[k]);
    outputs[k] = arg;
    const uint32_t nr = node->add_input_metadata(arg);
    if (torch::autograd::isDifferentiableType(arg.scalar_type())) {
      torch::autograd::impl::rebase_history(arg, {node, nr});
    }
    return true;
  }
  return false;
}

} // namespace torch_opaque::detail
