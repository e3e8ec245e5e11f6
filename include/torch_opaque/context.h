#pragma once
// torch_opaque::Context: the `ctx` of an op written in C++.
//
// It mirrors torch::autograd::AutogradContext, so C++ authors meet familiar
// names, but everything on it travels through schema values: saved tensors
// become references to inputs/outputs or residual outputs of `ns::Name_fwd`,
// and `saved_data` is encoded into the `str state` / `SymInt[] state_ints`
// arguments of `ns::Name_bwd` (see Note [Forward record]).

#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <torch_opaque/fake_checks.h>

#include <map>
#include <string>
#include <vector>

namespace torch_opaque {

class Context {
 public:
  Context() = default;
  explicit Context(std::vector<bool> needs_input_grad)
      : needs_input_grad_(std::move(needs_input_grad)) {}

  // Forward: tensors the backward needs (inputs, outputs or intermediates).
  void save_for_backward(std::vector<at::Tensor> tensors) { to_save_ = std::move(tensors); }
  // Backward: the saved tensors, in save order (undefined where an undefined
  // tensor was saved).
  const std::vector<at::Tensor>& saved_tensors() const { return to_save_; }
  std::vector<at::Tensor> get_saved_variables() const { return to_save_; }
  // Forward: tensors the op's `jvp` needs (forward-mode AD). In `jvp`,
  // saved_tensors() gives these, as in a Python autograd.Function.
  void save_for_forward(std::vector<at::Tensor> tensors) {
    for_forward_ = std::move(tensors);
  }

  // Non-tensor state for the backward. Supported values: int, double, bool,
  // string, None, SymInt, and lists of int, SymInt, double and bool (e.g.
  // x.sym_sizes().vec(), which keeps dynamic shapes symbolic).
  std::map<std::string, c10::IValue> saved_data;

  // Per forward argument: whether its gradient is needed. All false when the
  // call is not recorded for autograd.
  const std::vector<bool>& needs_input_grad() const { return needs_input_grad_; }
  bool needs_input_grad(size_t i) const {
    return i < needs_input_grad_.size() && needs_input_grad_[i];
  }

  // Forward: outputs that are not differentiable (indices, masks, ...).
  void mark_non_differentiable(const std::vector<at::Tensor>& outputs) {
    non_differentiable_.insert(non_differentiable_.end(), outputs.begin(), outputs.end());
  }
  // Forward: pass undefined tensors, instead of zeros, to backward for
  // outputs that received no gradient.
  void set_materialize_grads(bool value) { materialize_grads_ = value; }

  // In a `fake`: a new data-dependent size (the number of elements a
  // masked_select keeps, say), at least `min` and at most `max` (when given).
  // Valid while torch.export / torch.compile trace with fake tensors
  // (Note [Data-dependent sizes] in fake_checks.h); raises anywhere else.
  c10::SymInt new_dynamic_size(int64_t min = 0,
                               std::optional<int64_t> max = std::nullopt) const {
    return detail::new_dynamic_size(min, max);
  }

  // Internal (used by the kernels in op.h).
  const std::vector<at::Tensor>& non_differentiable() const { return non_differentiable_; }
  bool materialize_grads() const { return materialize_grads_; }
  void set_saved_tensors(std::vector<at::Tensor> t) { to_save_ = std::move(t); }
  std::vector<at::Tensor> take_saved_for_forward() { return std::move(for_forward_); }

 private:
  std::vector<bool> needs_input_grad_;
  std::vector<at::Tensor> to_save_;
  std::vector<at::Tensor> for_forward_;
  std::vector<at::Tensor> non_differentiable_;
  bool materialize_grads_ = true;
};

} // namespace torch_opaque
