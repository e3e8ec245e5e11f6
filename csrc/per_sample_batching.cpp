#include "per_sample_batching.h"

#include <torch_opaque/forward_record.h>

// Only this functorch header: DynamicLayer.h needs nlohmann/json, which torch
// does not ship (Note [Per-sample batching]: the level).
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace torch_opaque::detail {

// Note [Per-sample batching]
// C++ ops (def<Op>, OpDefinition::per_sample_batching) get this boxed kernel
// on FuncTorchBatched for `Name`, `Name_fwd`, `Name_bwd` and `Name_jvp`, so
// torch.func.vmap, jacrev, jacfwd and vmap(grad(f)) work on them: the
// arguments batched at the current vmap level are unwrapped, the op runs once
// per sample below the batching key, and the results are stacked along a new
// batch dimension 0. Tensor, Tensor? and tensor-list (Tensor[], Tensor?[])
// values are batched; anything else is passed as is. A `_fwd` run per sample
// reports one forward record per sample: they must agree (one backward node
// holds one record), and the first is reported as the call's. A `None` result
// (an undefined gradient of `_bwd`) in some samples but not others becomes
// zeros. Torch's own batching rules run inside the user's code for each
// sample, so the kernels need no batched variant; the cost is one call per
// sample. torch's older vmap (the Batched key, used by
// autograd.grad(..., is_grads_batched=True) and jacobian(vectorize=True))
// gets the user's backward and jvp kernels themselves on `_bwd` and `_jvp`
// (define_op), which run on its batched tensors as a stock Function's do.
// An op may give a batched forward of its own (a C++ op's `batched_forward`,
// OpDefinition::batched_forward): `Name` then runs it once on the whole batch
// (batched_forward_kernel); `_fwd`, `_bwd` and `_jvp` still run per sample.
// The Python front end registers its own rules (torch_opaque/_impl/batching.py).
// The level unwrapped is the highest level of a batched argument (read from
// the tensors: functorch's DynamicLayer.h, which tells the current level,
// cannot be included without nlohmann/json). It is the current vmap level
// whenever an argument is batched there; otherwise the arguments are batched
// only at outer levels, not wrapped by the layers in between, and running
// the samples of the highest of them here gives what that level would.
namespace {

using at::functorch::makeBatched;
using at::functorch::maybeGetBatchedImpl;

// Applies fn to each tensor in v (top level or a list element), in order.
c10::IValue map_tensors(const c10::IValue& v, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (v.isTensor()) return fn(v.toTensor());
  if (v.isList()) {
    c10::impl::GenericList list = v.toList();
    bool has_tensor = false;
    for (const c10::IValue& e : list) has_tensor = has_tensor || e.isTensor();
    if (!has_tensor) return v;
    c10::impl::GenericList out = list.copy();
    for (size_t i = 0; i < out.size(); ++i) {
      c10::IValue e = out.get(i);
      if (e.isTensor()) out.set(i, fn(e.toTensor()));
    }
    return out;
  }
  return v;
}

// The non-tensor state of a record, encoded (Note [Eager context state]).
std::pair<std::string, std::vector<c10::SymInt>> encoded_state(const ForwardRecord& r) {
  std::pair<std::string, std::vector<c10::SymInt>> out{r.state, r.state_ints};
  if (r.eager_state) {
    std::vector<at::Tensor> extra;
    r.eager_state->encode(out.first, out.second, extra);
  }
  return out;
}

bool same_record(const ForwardRecord& a, const ForwardRecord& b) {
  if (a.saved.size() != b.saved.size()) return false;
  for (size_t i = 0; i < a.saved.size(); ++i) {
    if (a.saved[i].kind != b.saved[i].kind || a.saved[i].index != b.saved[i].index ||
        a.saved[i].item != b.saved[i].item) {
      return false;
    }
  }
  return a.non_differentiable == b.non_differentiable &&
      a.materialize_grads == b.materialize_grads && encoded_state(a) == encoded_state(b);
}

// One return value, stacked over the samples and batched at `level`.
c10::IValue stack_samples(const std::string& op_name, size_t k,
                          const std::vector<c10::IValue>& samples, int64_t level) {
  const c10::IValue& first = samples.front();
  if (first.isTensor()) {
    std::vector<at::Tensor> parts;
    for (const auto& s : samples) parts.push_back(s.toTensor());
    return makeBatched(at::stack(parts), 0, level);
  }
  TORCH_INTERNAL_ASSERT(first.isList() || first.isNone(), op_name, ": result ", k,
                        " cannot be batched");
  if (first.isNone()) return first;
  const size_t len = first.toListRef().size();
  c10::impl::GenericList out = first.toList().copy();
  for (size_t j = 0; j < len; ++j) {
    std::vector<at::Tensor> parts;
    const at::Tensor* like = nullptr;
    for (const auto& s : samples) {
      c10::ArrayRef<c10::IValue> l = s.toListRef();
      TORCH_CHECK(l.size() == len, "torch_opaque: ", op_name, " under vmap: run once per "
                  "sample, it returned lists of different lengths (", len, " and ", l.size(),
                  ") for result ", k, ", which cannot be stacked into one batched result.");
      parts.push_back(l[j].isTensor() ? l[j].toTensor() : at::Tensor());
      if (parts.back().defined() && !like) like = &parts.back();
    }
    if (!like) continue;  // None (an undefined tensor) in every sample
    for (at::Tensor& p : parts) {
      if (!p.defined()) p = at::zeros_like(*like);
    }
    out.set(j, makeBatched(at::stack(parts), 0, level));
  }
  return out;
}

} // namespace

namespace {

// The arguments of one call, batched tensors replaced by their physical
// tensors at `level` with the batch dimension first.
struct Unwrapped {
  std::vector<c10::IValue> args;
  std::vector<bool> batched;  // per tensor, in map_tensors order
  int64_t level = -1;
  int64_t batch_size = -1;    // -1: nothing batched
};

Unwrapped unwrap_arguments(torch::jit::Stack* stack, size_t n_args) {
  Unwrapped u;
  u.args.assign(std::make_move_iterator(stack->end() - n_args),
                std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, n_args);
  for (const c10::IValue& a : u.args) {
    map_tensors(a, [&](const at::Tensor& t) {
      if (auto* impl = maybeGetBatchedImpl(t)) u.level = std::max(u.level, impl->level());
      return t;
    });
  }
  for (c10::IValue& a : u.args) {
    a = map_tensors(a, [&](const at::Tensor& t) {
      auto* impl = t.defined() ? maybeGetBatchedImpl(t) : nullptr;
      const bool here = impl && impl->level() == u.level;
      u.batched.push_back(here);
      if (!here) return t;
      at::Tensor front = impl->value().movedim(impl->bdim(), 0);
      u.batch_size = front.size(0);
      return front;
    });
  }
  return u;
}

} // namespace

void per_sample_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n_ret = schema.returns().size();
  Unwrapped u = unwrap_arguments(stack, schema.arguments().size());
  std::vector<c10::IValue>& args = u.args;
  const std::vector<bool>& batched = u.batched;
  const int64_t level = u.level, batch_size = u.batch_size;
  c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::FuncTorchBatched);
  if (batch_size < 0) {  // nothing batched at this level
    for (auto& a : args) stack->push_back(std::move(a));
    op.callBoxed(stack);
    return;
  }
  const std::string name = schema.operator_name().name;
  std::vector<std::vector<c10::IValue>> results(n_ret);
  std::optional<ForwardRecord> record;
  for (int64_t b = 0; b < batch_size; ++b) {
    torch::jit::Stack s;
    size_t i = 0;
    for (const c10::IValue& a : args) {
      s.push_back(map_tensors(a, [&](const at::Tensor& t) {
        return batched[i++] ? t.select(0, b) : t;
      }));
    }
    std::optional<ForwardRecord> r;
    {
      ForwardCallScope scope(std::nullopt);
      op.callBoxed(&s);
      r = scope.take_record();
    }
    TORCH_INTERNAL_ASSERT(s.size() == n_ret);
    if (b == 0) {
      record = std::move(r);
    } else {
      TORCH_CHECK(r.has_value() == record.has_value() && (!r || same_record(*r, *record)),
                  "torch_opaque: ", name, " under vmap: its forward, run once per sample, left "
                  "different ctx state or saved tensors for different samples (saved_data "
                  "values, which tensors were saved, or non-differentiable outputs), which one "
                  "backward cannot hold. Make them the same for every sample (keep "
                  "per-sample values in saved tensors instead of saved_data).");
    }
    for (size_t k = 0; k < n_ret; ++k) results[k].push_back(std::move(s[k]));
  }
  for (size_t k = 0; k < n_ret; ++k) {
    stack->push_back(stack_samples(name, k, results[k], level));
  }
  if (record) set_forward_record(std::move(*record));
}

void batched_forward_kernel(const BoxedKernel& fn, const c10::OperatorHandle& op,
                            torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  // Gradients of plain autograd (not torch.func.grad) are recorded per sample.
  bool records = false;
  if (at::GradMode::is_enabled()) {
    for (const c10::IValue& a : torch::jit::last(*stack, n_args)) {
      map_tensors(a, [&](const at::Tensor& t) {
        const at::Tensor* inner = &t;  // below every vmap level
        while (auto* impl = inner->defined() ? maybeGetBatchedImpl(*inner) : nullptr) {
          inner = &impl->value();
        }
        records = records || (inner->defined() && inner->requires_grad());
        return t;
      });
    }
  }
  if (records) {
    per_sample_kernel(op, stack);
    return;
  }
  Unwrapped u = unwrap_arguments(stack, n_args);
  c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKey::FuncTorchBatched);
  if (u.batch_size < 0) {
    for (auto& a : u.args) stack->push_back(std::move(a));
    op.callBoxed(stack);
    return;
  }
  size_t i = 0;
  for (const c10::IValue& a : u.args) {
    stack->push_back(map_tensors(a, [&](const at::Tensor& t) {
      if (u.batched[i++] || !t.defined()) return t;
      std::vector<int64_t> sizes{u.batch_size};
      for (int64_t d : t.sizes()) sizes.push_back(d);
      return t.unsqueeze(0).expand(sizes);
    }));
  }
  {
    ForwardCallScope scope(std::nullopt);  // no record: nothing is differentiated
    at::AutoGradMode no_grad(false);
    fn(schema, stack);
  }
  stack->pop_back();  // the residuals
  const std::string name = schema.operator_name().name;
  const size_t n_ret = schema.returns().size();
  for (auto v = stack->end() - n_ret; v != stack->end(); ++v) {
    *v = map_tensors(*v, [&](const at::Tensor& t) {
      TORCH_CHECK(t.dim() > 0 && t.size(0) == u.batch_size, "torch_opaque: ", name,
                  ": its batched_forward returned an output of shape ", t.sizes(), " for a batch of ",
                  u.batch_size, ". batched_forward gets every tensor argument with the batch as its "
                  "first dimension and must return every output with it first too.");
      return makeBatched(t, 0, u.level);
    });
  }
}

} // namespace torch_opaque::detail
