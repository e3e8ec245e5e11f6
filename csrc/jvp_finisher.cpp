#include <torch_opaque/detail/jvp_finisher.h>

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <utility>

namespace torch_opaque::detail {
namespace {

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

bool is_input(const at::Tensor& t, c10::ArrayRef<c10::IValue> inputs) {
  for (const c10::IValue& v : inputs) {
    if (v.isTensor() && same_tensor(t, v.toTensor())) return true;
  }
  return false;
}

bool is_one_of(const at::Tensor& t, c10::ArrayRef<at::Tensor> others) {
  for (const at::Tensor& o : others) {
    if (same_tensor(t, o)) return true;
  }
  return false;
}

} // namespace

std::vector<at::Tensor> pop_jvp_tangents(torch::jit::Stack* stack) {
  c10::List<std::optional<at::Tensor>> list = stack->back().toOptionalTensorList();
  stack->pop_back();
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    std::optional<at::Tensor> t = list.get(i);
    out.push_back(t.has_value() ? std::move(*t) : at::Tensor());
  }
  return out;
}

void finish_jvp(const std::string& op_name, c10::ArrayRef<c10::IValue> inputs,
                const std::vector<at::Tensor>& tangents_in, std::vector<at::Tensor> outputs,
                std::vector<at::Tensor> tangents_out, torch::jit::Stack* stack) {
  TORCH_CHECK(tangents_out.size() == outputs.size(), "torch_opaque: ", op_name, ": jvp returned ",
              tangents_out.size(), " tangents, but forward returns ", outputs.size(),
              " outputs. Return one tangent per output (an undefined at::Tensor() for a zero "
              "tangent).");
  for (size_t k = 0; k < outputs.size(); ++k) {
    at::Tensor& out = outputs[k];
    at::Tensor& t = tangents_out[k];
    if (!t.defined()) {
      t = at::zeros_like(out);
    } else {
      TORCH_CHECK(t.sizes() == out.sizes(), "torch_opaque: ", op_name,
                  ": jvp returned a tangent of shape ", t.sizes(), " for output ", k,
                  " of shape ", out.sizes(), ". Return tangents shaped like the outputs.");
      if (is_input(t, inputs) || is_one_of(t, tangents_in) || is_one_of(t, outputs)) {
        t = t.clone();
      }
    }
    if (is_input(out, inputs)) out = out.clone();
  }
  for (at::Tensor& out : outputs) stack->emplace_back(std::move(out));
  stack->emplace_back(c10::List<at::Tensor>(tangents_out));
}

} // namespace torch_opaque::detail
