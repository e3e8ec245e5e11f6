#include "autograd_kernel.h"
#include "forward_ad.h"
#include "nested_grad.h"
#include "in_place.h"
#include "replayed_records.h"

#include <ATen/core/List.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>

#include <optional>
#include <unordered_map>
#include <string>
#include <utility>
#include <vector>

namespace torch_opaque::detail {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Note [Opaque backward node]
// One node per op call. It holds the saved tensors as SavedVariables (so the
// usual "modified by an inplace operation" and "backward through the graph a
// second time" checks apply), the non-tensor record, and, per next edge, the
// `_bwd` result slot it takes its gradient from (the forward argument, or one
// element of a Tensor[] argument: Note [Tensor-list gradients]). apply() calls `ns::Name_bwd` through the
// dispatcher, so a traced backward shows it as one node; in plain eager mode
// it calls the op's backward kernel directly (Note [Direct backward] in
// opaque_op.h).
class OpaqueBackward final : public Node {
 public:
  OpaqueBackward(std::shared_ptr<OpaqueOp> op, std::vector<bool> needs_input_grad,
                 std::vector<size_t> edge_args, size_t num_slots, ForwardRecord record)
      : op_(std::move(op)),
        needs_input_grad_(std::move(needs_input_grad)),
        edge_args_(std::move(edge_args)),
        num_slots_(num_slots),
        materialize_grads_(record.materialize_grads),
        state_(std::move(record.state)),
        state_ints_(std::move(record.state_ints)),
        eager_state_(std::move(record.eager_state)) {}

  std::string name() const override {
    return op_->definition().ns + "::" + op_->definition().name + "Backward";
  }

  std::vector<SavedVariable>& saved() { return saved_; }

  // Note [Backward node introspection] (autograd_kernel.h).
  OpaqueNodeState introspect(bool with_saved) {
    OpaqueNodeState s{&op_->definition(), needs_input_grad_, {}, state_, state_ints_,
                      eager_state_.get()};
    if (!with_saved) return s;
    TORCH_CHECK(!released_, "Trying to access the saved tensors of ", name(),
                " after they were freed (the graph was backwarded through). Pass "
                "retain_graph=True to backward to keep them.");
    s.saved.reserve(saved_.size());
    for (const auto& sv : saved_) s.saved.push_back(sv.unpack(getptr()));
    return s;
  }

  // Note [Raw saved tensors] (autograd_kernel.h).
  std::vector<SavedVariable>& saved_variables() {
    TORCH_CHECK(!released_, "Trying to backward through the graph a second time (or directly "
                "access saved tensors after they have already been freed): the saved tensors "
                "of ", name(), " were freed by the backward pass. Pass retain_graph=True to "
                "backward to keep them.");
    return saved_;
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!released_, "Trying to backward through ", name(),
                " a second time (or to access its saved tensors after they were "
                "freed). Pass retain_graph=True to the first backward call if you "
                "need to backward twice.");
    std::vector<at::Tensor> saved;
    saved.reserve(saved_.size());
    for (const auto& sv : saved_) saved.push_back(sv.unpack(getptr()));
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined() && materialize_grads_) {
        grads[i] = input_metadata(i).zeros_like();
      }
    }
    // Note [Direct backward] (opaque_op.h).
    const DirectBackward& direct = op_->definition().direct_backward;
    if (direct && direct_call(saved, grads)) {
      BackwardArgs args{std::move(saved), std::move(grads), needs_input_grad_, state_,
                        state_ints_};
      at::AutoDispatchBelowADInplaceOrView below;
      return to_edges(direct(std::move(args), eager_state_.get()));
    }
    return to_edges(dispatch(saved, grads));
  }

  // Whether `_bwd` called through the dispatcher would go straight to its
  // CompositeExplicitAutograd kernel, below autograd (Note [Direct backward]).
  bool direct_call(const std::vector<at::Tensor>& saved, const variable_list& grads) const {
    if (at::GradMode::is_enabled() || c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
        at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value()) {
      return false;
    }
    c10::DispatchKeySet keys;
    for (const auto* l : {&saved, &grads}) {
      for (const at::Tensor& t : *l) {
        if (!t.defined()) continue;
        if (t._fw_grad(/*level=*/0).defined()) return false;
        keys = keys | t.key_set();
      }
    }
    // BackendSelect is always included and falls through for `_bwd`.
    const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
    keys = ((keys | tls.included_) - tls.excluded_) -
        c10::autograd_dispatch_keyset_with_ADInplaceOrView -
        c10::DispatchKeySet(c10::DispatchKey::BackendSelect);
    const c10::DispatchKey key = keys.highestPriorityTypeId();
    return c10::isIncludedInAlias(key, c10::DispatchKey::CompositeExplicitAutograd) &&
        !op_->backward_op().hasKernelForDispatchKey(key);
  }

  // `_bwd`'s result as the gradients of the next edges.
  variable_list to_edges(std::vector<at::Tensor> result) const {
    TORCH_CHECK(result.size() == num_slots_, op_->qualified_name(),
                ": the backward returned ", result.size(),
                " gradients, but the forward takes ", num_slots_,
                num_slots_ == op_->num_arguments() ? " arguments" : " arguments and list elements",
                ". Return one gradient (or None) per forward argument.");
    variable_list out(edge_args_.size());
    for (size_t e = 0; e < edge_args_.size(); ++e) out[e] = std::move(result[edge_args_[e]]);
    return out;
  }

  // `ns::Name_bwd` called through the dispatcher.
  std::vector<at::Tensor> dispatch(const std::vector<at::Tensor>& saved_tensors,
                                   const variable_list& grads) {
    auto optional_list = [](const std::vector<at::Tensor>& ts) {
      c10::List<std::optional<at::Tensor>> l;
      l.reserve(ts.size());
      for (const at::Tensor& t : ts) {
        l.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
      }
      return l;
    };
    c10::List<std::optional<at::Tensor>> saved_list = optional_list(saved_tensors);
    c10::List<std::optional<at::Tensor>> grad_list = optional_list(grads);
    c10::List<bool> needs;
    needs.reserve(needs_input_grad_.size());
    for (bool b : needs_input_grad_) needs.push_back(b);

    // Note [Eager context state]: objects go to the kernel directly, unless
    // this backward is being traced.
    const EagerState* eager = eager_state_.get();
    std::string state = state_;
    std::vector<c10::SymInt> state_ints = state_ints_;
    if (eager && !plain_call(saved_list, grad_list)) {
      std::vector<at::Tensor> all = saved_tensors;
      const size_t n_saved = all.size();
      eager->encode(state, state_ints, all);
      for (size_t i = n_saved; i < all.size(); ++i) saved_list.push_back(all[i]);
      eager = nullptr;
    }
    const c10::FunctionSchema& bwd_schema = op_->backward_op().schema();
    EagerStateScope scope(eager ? &bwd_schema : nullptr, eager);
    torch::jit::Stack stack;
    stack.reserve(5);
    stack.emplace_back(saved_list);
    stack.emplace_back(grad_list);
    stack.emplace_back(std::move(needs));
    stack.emplace_back(std::move(state));
    stack.emplace_back(c10::SymIntArrayRef(state_ints));
    if (at::GradMode::is_enabled() || has_tangents(saved_list) || has_tangents(grad_list)) {
      // Note [Nested grad]: under a torch.func level the backward runs as
      // user code of that level.
      std::optional<c10::DispatchKeySet> direct = backward_as_user_code(saved_list, grad_list);
      if (direct) {
        try {
          op_->backward_op().redispatchBoxed(*direct, &stack);
        } catch (const std::exception& e) {
          // Only a backward that reads tensor memory directly is told why.
          const std::string what = e.what();
          if (what.find("doesn't have storage") == std::string::npos) throw;
          TORCH_CHECK(false, "torch_opaque: ", op_->qualified_name(),
                      ": the backward failed under a torch.func transform. There it runs on the "
                      "transform's wrapped tensors, as a stock Function's backward does, so it "
                      "must be written with torch operations (not numpy or .data_ptr()); use "
                      "torch.autograd.grad outside torch.func instead. The error was: ", e.what());
        }
      } else {
        op_->backward_op().callBoxed(stack);
      }
    } else {
      // No graph is being built: skip the Autograd fallback of `_bwd`.
      at::AutoDispatchBelowADInplaceOrView below;
      op_->backward_op().callBoxed(stack);
    }
    TORCH_INTERNAL_ASSERT(stack.size() == 1);
    std::vector<at::Tensor> result;
    for (const auto& g : stack.back().toOptionalTensorList()) {
      std::optional<at::Tensor> t = g;
      result.push_back(t.has_value() ? std::move(*t) : at::Tensor());
    }
    return result;
  }

  // Whether a tensor carries a forward gradient: then `_bwd`'s Autograd
  // kernel runs the backward so that its operations propagate it, with grad
  // mode on or off (Note [Double backward]).
  static bool has_tangents(const c10::List<std::optional<at::Tensor>>& l) {
    for (size_t i = 0; i < l.size(); ++i) {
      std::optional<at::Tensor> t = l.get(i);
      if (t.has_value() && t->defined() && t->_fw_grad(/*level=*/0).defined()) return true;
    }
    return false;
  }

  // Whether `_bwd` reaches its kernel untraced: no Python dispatch mode is
  // active and no tensor is a subclass, fake or functional tensor.
  static bool plain_call(const c10::List<std::optional<at::Tensor>>& a,
                         const c10::List<std::optional<at::Tensor>>& b) {
    if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
    const c10::DispatchKeySet traced(
        {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
         c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
         c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
         c10::DispatchKey::Batched});
    if (!(c10::impl::tls_local_dispatch_key_set().included_ & traced).empty()) return false;
    for (const auto& l : {a, b}) {
      for (size_t i = 0; i < l.size(); ++i) {
        std::optional<at::Tensor> t = l.get(i);
        if (t.has_value() && t->defined() && t->key_set().has_any(traced)) return false;
      }
    }
    return true;
  }

  void release_variables() override {
    for (auto& sv : saved_) sv.reset_data();
    released_ = !saved_.empty();
  }

 private:
  std::shared_ptr<OpaqueOp> op_;
  std::vector<bool> needs_input_grad_;
  std::vector<size_t> edge_args_;  // per next edge: its slot in `_bwd`'s result
  size_t num_slots_;
  std::vector<SavedVariable> saved_;
  bool materialize_grads_;
  std::string state_;
  std::vector<c10::SymInt> state_ints_;
  std::shared_ptr<const EagerState> eager_state_;
  bool released_ = false;
};

// `_fwd`'s needs_input_grad as a c10::List. That argument is immutable in
// `_fwd`'s schema, so lists of up to 8 flags are made once per pattern (and
// thread) and shared: two fewer allocations per recorded call.
c10::List<bool> flag_list(c10::ArrayRef<bool> flags) {
  auto make = [&] {
    c10::List<bool> l;
    l.reserve(flags.size());
    for (bool b : flags) l.push_back(b);
    return l;
  };
  if (flags.size() > 8) return make();
  thread_local std::unordered_map<uint32_t, c10::List<bool>> cache;
  uint32_t key = static_cast<uint32_t>(flags.size()) << 8;
  for (size_t i = 0; i < flags.size(); ++i) key |= static_cast<uint32_t>(flags[i]) << i;
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make()).first;
  return it->second;  // (a copy shares the list)
}

} // namespace

const std::type_info& opaque_backward_type() { return typeid(OpaqueBackward); }

OpaqueNodeState opaque_node_state(Node& node, bool with_saved) {
  auto* n = dynamic_cast<OpaqueBackward*>(&node);
  TORCH_INTERNAL_ASSERT(n, "opaque_node_state: not a torch_opaque backward node");
  return n->introspect(with_saved);
}

std::vector<SavedVariable>& opaque_node_saved_variables(Node& node) {
  auto* n = dynamic_cast<OpaqueBackward*>(&node);
  TORCH_INTERNAL_ASSERT(n, "opaque_node_saved_variables: not a torch_opaque backward node");
  return n->saved_variables();
}

void AutogradKernel::operator()(const c10::OperatorHandle& handle,
                                c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  std::shared_ptr<OpaqueOp> op = op_.lock();
  TORCH_INTERNAL_ASSERT(op, "opaque op used after its definition was destroyed");
  if (forward_op_) {
    // `_fwd`: its trailing needs_input_grad is no forward argument, and its
    // residuals come from the reverse-mode call.
    c10::IValue flags = std::move(stack->back());
    stack->pop_back();
    const bool tangents = has_forward_grads(*stack, op->num_arguments());
    auto call = [&](torch::jit::Stack* s) {
      s->push_back(std::move(flags));
      reverse(op, handle, keys, s);
    };
    if (tangents) {
      run_with_forward_grads(*op, stack, call, /*n_extra=*/1);
    } else {
      call(stack);
    }
    return;
  }
  if (has_forward_grads(*stack, op->num_arguments())) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        forward_op_ || op->definition().dirty.empty(), "torch_opaque: ", op->qualified_name(),
        " modifies its arguments in place (ctx.mark_dirty); forward-mode AD through an "
        "in-place op is not supported. Pass a copy (x.clone()) or use reverse mode.");
    run_with_forward_grads(*op, stack, [&](torch::jit::Stack* s) { reverse(op, handle, keys, s); });
    return;
  }
  reverse(op, handle, keys, stack);
}

void AutogradKernel::reverse(const std::shared_ptr<OpaqueOp>& op,
                             const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  const size_t n_args = op->num_arguments();
  const size_t n_out = op->num_outputs();
  // `_fwd`: its needs_input_grad argument is replaced by the flags below.
  c10::IValue fwd_flags;
  if (forward_op_) {
    fwd_flags = std::move(stack->back());
    stack->pop_back();
  }

  // Which forward arguments are differentiable tensors that require grad.
  // Top-level Tensor / Tensor? arguments are differentiable, as for
  // torch.autograd.Function; the elements of Tensor[] arguments too when the
  // op differentiates lists (C++ ops, as torch::autograd::Function), each
  // with a `_bwd` result slot of its own (Note [Tensor-list gradients]).
  // (Inline vectors: a call that records nothing allocates none of them.)
  c10::SmallVector<bool, 8> needs(n_args, false);
  c10::SmallVector<size_t, 8> edge_args;  // per edge: its `_bwd` result slot
  c10::SmallVector<at::Tensor, 8> edge_tensors;
  size_t n_slots = 0;
  bool any = false;
  {
    auto args = torch::jit::last(*stack, n_args);
    const bool grad_on = at::GradMode::is_enabled();
    const bool lists = op->definition().differentiate_lists;
    auto add_edge = [&](size_t i, const at::Tensor& t) {
      edge_args.push_back(n_slots);
      edge_tensors.push_back(t);
      if (grad_on && t.defined() && t.requires_grad()) {
        needs[i] = true;
        any = true;
      }
    };
    for (size_t i = 0; i < n_args; ++i) {
      if (args[i].isTensor()) {
        add_edge(i, args[i].toTensor());
        ++n_slots;
      } else if (lists && args[i].isTensorList()) {
        for (const at::Tensor& t : args[i].toTensorList().vec()) {
          // Top-level tangents take the forward-AD path (forward_ad.cpp); a
          // list element's would be dropped, so it is refused as stock
          // refuses a Function without jvp.
          TORCH_CHECK_NOT_IMPLEMENTED(
              !t.defined() || !t._fw_grad(/*level=*/0).defined(), op->qualified_name(),
              ": argument '", handle.schema().arguments()[i].name(),
              "' (Tensor[]) holds dual tensors, but forward-mode AD through tensor-list "
              "elements is not supported; compute the jvp with reverse mode (torch.func.vjp).");
          add_edge(i, t);
          ++n_slots;
        }
      } else {
        ++n_slots;
      }
    }
  }
  // Note [Nested grad]: a level above waits for this `_fwd`'s record and
  // passes its needs_input_grad down.
  const bool nested = under_functorch_level(keys);
  NestedForwardScope* above = forward_op_ ? NestedForwardLink::waiting(op.get()) : nullptr;
  // `ns::Name` of an in-place op: the arguments it modifies (Note [In-place ops]).
  const OpDefinition& def = op->definition();
  std::vector<at::Tensor> dirty;
  if (!forward_op_ && !def.dirty.empty()) dirty = dirty_arguments(def, *stack, n_args);
  if (!any) {
    if (forward_op_) stack->push_back(std::move(fwd_flags));
    at::AutoDispatchBelowADInplaceOrView guard;
    std::optional<at::AutoGradMode> no_grad;
    if (above) no_grad.emplace(false);  // the forward runs without grad
    // Note [Eager state is for nodes]: only a level above takes this record.
    NodeTakesRecordScope takes(above != nullptr);
    handle.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    return;
  }
  check_in_place(def, dirty, n_out);

  // Keep the inputs: they become next edges and may be saved.
  c10::SmallVector<c10::IValue, 8> inputs(stack->end() - n_args, stack->end());
  std::optional<ForwardRecord> record;
  {
    c10::SmallVector<bool, 8> flags(needs.begin(), needs.end());
    if (above) {
      const c10::List<bool> flags_above = fwd_flags.toBoolList();
      for (size_t i = 0; i < flags.size() && i < flags_above.size(); ++i) {
        flags[i] = flags[i] || flags_above.get(i);
      }
    }
    stack->emplace_back(flag_list(flags));  // `_fwd`'s needs_input_grad
    ForwardCallScope scope(std::nullopt);
    NodeTakesRecordScope takes(true);  // Note [Eager state is for nodes]
    // Under a transform level the levels below record `_fwd` too (grad mode
    // stays on for them) and the lowest one takes the record first.
    std::optional<NestedForwardScope> below_levels;
    if (nested) below_levels.emplace(op.get());
    at::AutoDispatchBelowADInplaceOrView guard;
    at::AutoGradMode no_grad(nested);  // forwards run without grad, as in autograd.Function
    op->forward_op().callBoxed(stack);
    record = scope.take_record();
    if (!record && below_levels) record = below_levels->take();
  }
  {
    // Note [Records of replayed forwards] (replayed_records.h).
    at::Tensor first;
    if (n_out > 0 && stack->size() >= n_out + 1) {
      const c10::IValue& v = *(stack->end() - n_out - 1);
      if (v.isTensor()) first = v.toTensor();
    }
    if (record && keeps_records(first)) {
      remember_record(first, *record);
    } else if (!record && first.defined()) {
      record = replayed_record(first);
    }
  }
  TORCH_CHECK(record.has_value(), op->qualified_name(),
              ": the forward kernel did not report its saved state "
              "(torch_opaque::set_forward_record was not called).");
  if (above) NestedForwardLink::hand_up(above, *record);
  TORCH_INTERNAL_ASSERT(stack->size() >= n_out + 1);
  c10::List<at::Tensor> residuals = stack->back().toTensorList();
  stack->pop_back();
  // The outputs, with the elements of a Tensor[] output one by one: each is
  // an input of the backward node (saved-output indices count them so too).
  c10::SmallVector<at::Tensor, 8> outputs;
  for (auto it = stack->end() - n_out; it != stack->end(); ++it) {
    if (it->isTensorList()) {
      for (const at::Tensor& t : it->toTensorList().vec()) outputs.push_back(t);
    } else {
      TORCH_CHECK(it->isTensor(), op->qualified_name(), ": output ",
                  it - (stack->end() - n_out), " is not a Tensor.");
      outputs.push_back(it->toTensor());
    }
  }

  std::vector<SavedRef> saved_refs = std::move(record->saved);
  std::vector<bool> non_diff = std::move(record->non_differentiable);
  TORCH_CHECK(non_diff.empty() || non_diff.size() == outputs.size(), op->qualified_name(),
              ": non_differentiable has ", non_diff.size(), " entries for ", outputs.size(),
              " outputs.");
  auto node = c10::make_intrusive<OpaqueBackward>(
      op, std::vector<bool>(needs.begin(), needs.end()),
      std::vector<size_t>(edge_args.begin(), edge_args.end()), n_slots, std::move(*record));
  node->set_next_edges(
      torch::autograd::collect_next_edges(at::ArrayRef<at::Tensor>(edge_tensors)));

  for (size_t k = 0; k < outputs.size(); ++k) {
    if (!dirty.empty() && rebase_dirty_output(def, dirty, k, outputs, node)) continue;
    const at::Tensor& out = outputs[k];
    const bool diff = out.defined() && (non_diff.empty() || !non_diff[k]) &&
        torch::autograd::isDifferentiableType(out.scalar_type());
    if (diff) {
      torch::autograd::set_history(out, node);
    } else if (out.defined()) {
      node->add_input_metadata(out);
    } else {
      node->add_input_metadata(Node::undefined_input());
    }
  }

  auto& saved = node->saved();
  saved.reserve(saved_refs.size());
  for (const SavedRef& ref : saved_refs) {
    switch (ref.kind) {
      case SavedKind::None:
        saved.emplace_back();
        break;
      case SavedKind::Input:
        TORCH_CHECK(ref.index >= 0 && static_cast<size_t>(ref.index) < n_args &&
                        inputs[ref.index].isTensor(),
                    op->qualified_name(), ": saved input ", ref.index,
                    " is not a tensor argument.");
        saved.emplace_back(inputs[ref.index].toTensor(), /*is_output=*/false);
        break;
      case SavedKind::InputListItem:
        TORCH_CHECK(ref.index >= 0 && static_cast<size_t>(ref.index) < n_args &&
                        inputs[ref.index].isTensorList(),
                    op->qualified_name(), ": saved input ", ref.index,
                    " is not a tensor-list argument.");
        saved.emplace_back(inputs[ref.index].toTensorList().get(ref.item),
                           /*is_output=*/false);
        break;
      case SavedKind::Output:
        TORCH_CHECK(ref.index >= 0 && static_cast<size_t>(ref.index) < outputs.size(),
                    op->qualified_name(), ": saved output ", ref.index,
                    " does not exist.");
        saved.emplace_back(outputs[ref.index], /*is_output=*/true);
        break;
      case SavedKind::Residual:
        TORCH_CHECK(ref.index >= 0 &&
                        static_cast<size_t>(ref.index) < residuals.size(),
                    op->qualified_name(), ": residual ", ref.index,
                    " was not returned by the forward kernel.");
        saved.emplace_back(residuals.get(ref.index), /*is_output=*/false);
        break;
    }
  }
  if (forward_op_) stack->emplace_back(std::move(residuals));
  const size_t first = stack->size() - n_out;
  for (size_t k = n_out; !dirty.empty() && k-- > 0;) {  // `ns::Name` returns the others
    if (dirty_argument(def, k)) stack->erase(stack->begin() + first + k);
  }
}

} // namespace torch_opaque::detail
