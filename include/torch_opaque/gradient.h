#pragma once
// torch_opaque::Gradient: one entry of a C++ backward's result, the gradient
// of one forward argument.
//
// A backward returns one entry per forward argument (after ctx), as
// std::vector<at::Tensor> or, when a forward argument is a tensor list, as
// std::vector<torch_opaque::Gradient>:
//   - a Tensor / Tensor? argument: a tensor (undefined for "no gradient");
//   - a Tensor[] argument (std::vector<at::Tensor>, at::TensorList): a
//     std::vector<at::Tensor> with one gradient per list element (undefined
//     entries for elements without one), or an undefined tensor / empty list
//     when no element gets a gradient;
//   - any other argument: an undefined tensor.
//
//   return {std::vector<at::Tensor>{g0, g1}, grad_w};

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace torch_opaque {

class Gradient {
 public:
  Gradient() = default;
  Gradient(at::Tensor tensor) : tensor_(std::move(tensor)) {}  // NOLINT: implicit
  Gradient(std::vector<at::Tensor> list)                        // NOLINT: implicit
      : list_(std::move(list)), is_list_(true) {}

  bool is_list() const { return is_list_; }
  const at::Tensor& tensor() const { return tensor_; }
  const std::vector<at::Tensor>& list() const { return list_; }
  // No gradient at all: an undefined tensor or an empty list.
  bool empty() const { return is_list_ ? list_.empty() : !tensor_.defined(); }

 private:
  at::Tensor tensor_;
  std::vector<at::Tensor> list_;
  bool is_list_ = false;
};

} // namespace torch_opaque
