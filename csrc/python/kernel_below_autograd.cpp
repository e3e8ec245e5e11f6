#include "kernel_below_autograd.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <optional>
#include <stdexcept>
#include <utility>

namespace py = pybind11;

namespace torch_opaque::python {
namespace {

// The backend kernel key of a call's tensors: the highest backend among them
// (fake tensors carry the backend of the device they stand for).
c10::DispatchKeySet backend_keys(const torch::jit::Stack& stack) {
  c10::DispatchKeySet all;
  auto add = [&all](const at::Tensor& t) {
    if (t.defined()) all = all | t.key_set();
  };
  for (const c10::IValue& v : stack) {
    if (v.isTensor()) {
      add(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) add(t);
    } else if (v.isList()) {
      for (const c10::IValue& item : v.toListRef()) {
        if (item.isTensor()) add(item.toTensor());
      }
    }
  }
  c10::BackendComponent backend = all.highestBackendKey();
  if (backend == c10::BackendComponent::InvalidBit) backend = c10::BackendComponent::CPUBit;
  return c10::DispatchKeySet(c10::DispatchKey::Dense) | c10::DispatchKeySet(backend);
}

} // namespace

py::tuple record_to_python(const ForwardRecord& record) {
  py::list saved;
  for (const SavedRef& r : record.saved) {
    saved.append(static_cast<int64_t>(r.kind));
    saved.append(r.index);
    saved.append(r.item);
  }
  py::list non_diff;
  for (bool b : record.non_differentiable) non_diff.append(b);
  // A C++ forward keeps ctx.saved_data as it is (Note [Eager context state]);
  // the record returned here is written into graphs, so it is encoded.
  std::string state = record.state;
  std::vector<c10::SymInt> state_ints = record.state_ints;
  if (record.eager_state) {
    std::vector<at::Tensor> state_tensors;
    record.eager_state->encode(state, state_ints, state_tensors);
    TORCH_INTERNAL_ASSERT(state_tensors.empty(), "a C++ forward's saved_data holds no tensors");
  }
  return py::make_tuple(saved, non_diff, record.materialize_grads, state, state_ints);
}

py::tuple call_kernel_below_autograd(const std::string& name, const std::string& overload,
                                     py::tuple args) {
  try {
    c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    torch::jit::Stack stack =
        torch::jit::createStackForSchema(op.schema(), args, py::kwargs(), std::nullopt);
    const c10::DispatchKeySet keys = backend_keys(stack);
    std::optional<ForwardRecord> record;
    {
      detail::ForwardCallScope scope(std::nullopt);
      op.redispatchBoxed(keys, &stack);
      record = scope.take_record();
    }
    py::object out = torch::jit::createPyObjectForStack(std::move(stack));
    return py::make_tuple(out, record ? py::object(record_to_python(*record)) : py::none());
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

} // namespace torch_opaque::python
