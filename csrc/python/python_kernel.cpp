#include "python_kernel.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <memory>

namespace py = pybind11;

namespace torch_opaque::python {
namespace {

py::object to_python(const c10::IValue& v, const c10::Argument& arg) {
  const auto& real = arg.real_type();
  if (v.isInt() && real->kind() == c10::TypeKind::ScalarTypeType) {
    auto* dtype = torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()));
    return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(dtype));
  }
  return torch::jit::toPyObject(v);
}

} // namespace

BoxedKernel make_python_kernel(py::object fn) {
  // Kernels live for the rest of the process (see all_ops()), so the callable
  // is deliberately never released: releasing it at exit would need the GIL
  // after the interpreter is gone.
  auto* holder = new py::object(std::move(fn));
  return [holder](const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
    py::gil_scoped_acquire gil;
    const auto& args = schema.arguments();
    const size_t n = args.size();
    py::tuple py_args(n);
    auto values = torch::jit::last(*stack, n);
    for (size_t i = 0; i < n; ++i) py_args[i] = to_python(values[i], args[i]);
    torch::jit::drop(*stack, n);
    py::object result = (*holder)(*py_args);
    const auto& rets = schema.returns();
    TORCH_CHECK(py::isinstance<py::tuple>(result), schema.name(),
                ": the Python kernel must return a tuple of ", rets.size(), " values.");
    auto tup = py::reinterpret_borrow<py::tuple>(result);
    TORCH_CHECK(tup.size() == rets.size(), schema.name(), ": the Python kernel returned ",
                tup.size(), " values, the schema has ", rets.size(), " returns.");
    for (size_t i = 0; i < rets.size(); ++i) {
      stack->push_back(torch::jit::toIValue(tup[i], rets[i].type()));
    }
  };
}

} // namespace torch_opaque::python
