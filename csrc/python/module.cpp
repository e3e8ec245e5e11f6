// torch_opaque._C: the Python face of the C++ core.
#include "context_types.h"
#include "direct_apply.h"
#include "kernel_below_autograd.h"
#include "op_call.h"
#include "backward_node_type.h"
#include "python_kernel.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch_opaque/fake_checks.h>
#include <torch_opaque/forward_record.h>
#include <torch_opaque/opaque_op.h>

#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace torch_opaque::python {
namespace {

void set_forward_record_py(const std::vector<int64_t>& saved,
                           const std::vector<bool>& non_differentiable,
                           bool materialize_grads, std::string state,
                           const std::vector<c10::SymInt>& state_ints) {
  TORCH_CHECK(saved.size() % 3 == 0, "saved must hold (kind, index, item) triples");
  ForwardRecord r;
  r.saved.reserve(saved.size() / 3);
  for (size_t i = 0; i < saved.size(); i += 3) {
    TORCH_CHECK(saved[i] >= 0 && saved[i] <= 4, "bad saved kind ", saved[i]);
    r.saved.push_back({static_cast<SavedKind>(saved[i]), saved[i + 1], saved[i + 2]});
  }
  r.non_differentiable = non_differentiable;
  r.materialize_grads = materialize_grads;
  r.state = std::move(state);
  r.state_ints = state_ints;
  set_forward_record(std::move(r));
}

// Note [Sharding opaque ops] (torch_opaque/integrations/sharding.py): the DTensor
// handler of `_fwd` ran the forward kernel on redistributed local tensors, so
// saved arguments it redistributed become the residuals it appended (one
// (index, item or -1, residual) triple each), and one more residual is saved
// last. False when no record is pending (the call is not recorded).
bool reroute_forward_record(const std::vector<std::tuple<int64_t, int64_t, int64_t>>& inputs,
                            int64_t extra_residual) {
  ForwardRecord* r = detail::pending_forward_record();
  if (r == nullptr) return false;
  for (SavedRef& ref : r->saved) {
    for (const auto& [index, item, residual] : inputs) {
      const bool whole = ref.kind == SavedKind::Input && item < 0;
      const bool element = ref.kind == SavedKind::InputListItem && ref.item == item;
      if (ref.index == index && (whole || element)) {
        ref = SavedRef{SavedKind::Residual, residual, 0};
        break;
      }
    }
  }
  r->saved.push_back(SavedRef{SavedKind::Residual, extra_residual, 0});
  return true;
}

// Note [Data-dependent sizes] (fake_checks.h): a C++ fake's
// ctx.new_dynamic_size() asks the fake tracing context for an unbacked size.
c10::SymInt dynamic_size_from_python(int64_t min, std::optional<int64_t> max) {
  py::gil_scoped_acquire gil;
  py::object fn = py::module_::import("torch_opaque._impl.bridge").attr("new_dynamic_size");
  return py::cast<c10::SymInt>(fn(min, max));
}

// Note [Batching rules] (_impl/batching.py): a batching rule runs the user's
// code as user code of its vmap level, with the thread-local dispatch key
// state functorch saved on the level when it entered it (read by the caller
// from the level's interpreter), not in functorch's processing state.
py::object call_with_dispatch_keys(const py::function& fn, uint64_t included,
                                   uint64_t excluded) {
  c10::impl::PODLocalDispatchKeySet pod;
  pod.set_included(c10::DispatchKeySet::from_raw_repr(included));
  pod.set_excluded(c10::DispatchKeySet::from_raw_repr(excluded));
  c10::impl::ForceDispatchKeyGuard keys{c10::impl::LocalDispatchKeySet(pod)};
  return fn();
}

} // namespace
} // namespace torch_opaque::python

PYBIND11_MODULE(_C, m) {
  using namespace torch_opaque;
  using namespace torch_opaque::python;
  m.doc() = "torch_opaque C++ core";
  if (!add_direct_apply_type(m.ptr()) || !add_op_call_type(m.ptr()) ||
      !add_context_types(m.ptr()) || !register_backward_node_type()) {
    throw py::error_already_set();
  }
  py::class_<OpaqueOp, std::shared_ptr<OpaqueOp>>(m, "OpaqueOp")
      .def_property_readonly("qualified_name", &OpaqueOp::qualified_name)
      .def_property_readonly("num_arguments", &OpaqueOp::num_arguments)
      .def_property_readonly("num_outputs", &OpaqueOp::num_outputs);
  m.def(
      "define_op",
      [](std::string ns, std::string name, std::string overload, std::string arguments,
         std::vector<std::string> returns, py::object forward, py::object backward,
         std::vector<std::pair<size_t, size_t>> dirty) {
        OpDefinition def;
        def.ns = std::move(ns);
        def.name = std::move(name);
        def.overload = std::move(overload);
        def.arguments = std::move(arguments);
        def.returns = std::move(returns);
        def.forward = make_python_forward(std::move(forward));
        def.direct_backward = make_python_backward(std::move(backward));
        def.dirty = std::move(dirty);
        return define_op(std::move(def));
      },
      py::arg("ns"), py::arg("name"), py::arg("overload"), py::arg("arguments"),
      py::arg("returns"), py::arg("forward"), py::arg("backward"),
      py::arg("dirty") = std::vector<std::pair<size_t, size_t>>(),
      "Define ns::Name, Name_fwd and Name_bwd; `dirty`: (output, argument) pairs of an "
      "in-place op (Note [In-place ops] in csrc/in_place.cpp).");
  m.def(
      "release_op",
      [](const OpaqueOp& op, long users) { return release_op(op, users); },
      py::arg("op"), py::arg("users"),
      "Undo define_op once nothing runs the op (see release_op in opaque_op.h): True "
      "when released, False while autograd nodes still use it.");
  m.def("run_forward", &run_forward_from_python, py::arg("runner"), py::arg("forward"),
        py::arg("setup_context"), py::arg("needs"), py::arg("args"),
        "Run a kernels.Runner's forward like the real kernel, from Python (Note [Python "
        "kernels]): (outputs, residuals, record or None).");
  m.def("run_first_forward", &run_first_forward_from_python, py::arg("runner"),
        py::arg("needs"), py::arg("args"),
        "Run a kernels.Runner's forward as the kernel would while the number of outputs is "
        "unknown (Note [First call runs forward once]): (what forward returned, ctx).");
  m.def("run_backward", &run_backward_from_python, py::arg("runner"), py::arg("backward"),
        py::arg("saved"), py::arg("grads"), py::arg("needs_input_grad"), py::arg("state"),
        py::arg("state_ints"),
        "Run a kernels.BackwardRunner's backward like the real kernel, from Python.");
  m.def("call_kernel_below_autograd", &call_kernel_below_autograd, py::arg("name"),
        py::arg("overload"), py::arg("args"),
        "Run an op's kernel for its tensors' backend, below autograd and Python dispatch "
        "modes, so that its ATen calls are traced (Note [Kernels below autograd]): (what it "
        "returns, forward record or None).");
  m.def("take_registration_errors", &take_registration_errors,
        "Failures recorded by TORCH_OPAQUE_DEF registrations since the last call "
        "(Note [Static registration errors]); the record is emptied.");
  m.def("set_primed", &set_primed, py::arg("runner"), py::arg("out"), py::arg("ctx"),
        "Hand the next forward kernel of `runner` on this thread the result of a forward "
        "already run (Note [First call runs forward once]); None clears it.");
  torch_opaque::detail::set_dynamic_size_hook(&dynamic_size_from_python);
  m.def("call_with_dispatch_keys", &call_with_dispatch_keys, py::arg("fn"),
        py::arg("included"), py::arg("excluded"),
        "fn() with the thread-local dispatch key sets given as raw representations "
        "(Note [Batching rules] in _impl/batching.py).");
  m.def("set_debug", &set_debug, py::arg("on"));
  m.def("debug_enabled", &debug_enabled);
  m.def("reroute_forward_record", &reroute_forward_record, py::arg("inputs"),
        py::arg("extra_residual"),
        "Point the pending forward record's saved arguments at residuals and save one "
        "more residual (Note [Sharding opaque ops]); False when none is pending.");
  m.def("set_forward_record", &set_forward_record_py, py::arg("saved"),
        py::arg("non_differentiable"), py::arg("materialize_grads"), py::arg("state"),
        py::arg("state_ints"));
}
