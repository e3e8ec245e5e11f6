#include "python_kernel.h"

#include "context_types.h"
#include "kernel_below_autograd.h"

#include <torch_opaque/detail/finishers.h>
#include <torch_opaque/forward_record.h>

#include <c10/core/InferenceMode.h>
#include <c10/core/AutogradState.h>
#include <c10/core/GradMode.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

namespace py = pybind11;

namespace torch_opaque::python {
namespace {

// How each argument is converted, worked out once per schema: tensors and
// dtypes skip the generic IValue -> PyObject conversion.
enum class Kind : uint8_t { Generic, Tensor, ScalarType, TensorList };

Kind kind_of(const c10::Argument& a) {
  const auto& real = a.real_type();
  if (real->kind() == c10::TypeKind::TensorType) return Kind::Tensor;
  if (real->kind() == c10::TypeKind::ScalarTypeType) return Kind::ScalarType;
  if (real->kind() == c10::TypeKind::ListType &&
      real->containedType(0)->kind() == c10::TypeKind::TensorType) {
    return Kind::TensorList;
  }
  return Kind::Generic;
}

py::object steal(PyObject* o) {
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

PyObject* wrap_tensor(const at::Tensor& t) {
  PyObject* o = THPVariable_Wrap(t);
  if (!o) throw py::error_already_set();
  return o;
}

PyObject* to_python(const c10::IValue& v, Kind kind) {
  if (kind == Kind::Tensor && v.isTensor()) return wrap_tensor(v.toTensor());
  if (kind == Kind::ScalarType && v.isInt()) {
    auto* dtype = torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()));
    Py_INCREF(dtype);
    return reinterpret_cast<PyObject*>(dtype);
  }
  if (kind == Kind::TensorList && v.isTensorList()) {
    const auto list = v.toTensorList();
    py::list l(list.size());
    for (size_t j = 0; j < list.size(); ++j) {
      PyList_SET_ITEM(l.ptr(), static_cast<Py_ssize_t>(j), wrap_tensor(list.get(j)));
    }
    return l.release().ptr();
  }
  return torch::jit::toPyObject(v).release().ptr();
}

PyObject* new_bool_tuple(const std::vector<bool>& flags) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(flags.size()));
  if (!t) throw py::error_already_set();
  for (size_t j = 0; j < flags.size(); ++j) {
    PyObject* b = flags[j] ? Py_True : Py_False;
    Py_INCREF(b);
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(j), b);
  }
  return t;
}

// needs_input_grad as a tuple of bools (new reference). Tuples are immutable,
// so those of up to 8 flags are made once per pattern and shared: two fewer
// allocations (and less GC work) per forward+backward.
PyObject* bool_tuple(const std::vector<bool>& flags) {
  constexpr size_t kMax = 8;
  const size_t n = flags.size();
  if (n > kMax) return new_bool_tuple(flags);
  static PyObject* cache[kMax + 1][1 << kMax] = {};  // kept for the process
  size_t bits = 0;
  for (size_t j = 0; j < n; ++j) bits |= static_cast<size_t>(flags[j]) << j;
  PyObject*& slot = cache[n][bits];
  if (!slot) slot = new_bool_tuple(flags);
  Py_INCREF(slot);
  return slot;
}

// A tensor or None from Python (validated by the caller or by ctx).
at::Tensor tensor_or_undefined(PyObject* o) {
  return THPVariable_Check(o) ? THPVariable_Unpack(o) : at::Tensor();
}

std::vector<at::Tensor> tensors_of(PyObject* seq) {
  py::object fast = steal(PySequence_Fast(seq, "expected a sequence of tensors"));
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out.push_back(tensor_or_undefined(PySequence_Fast_GET_ITEM(fast.ptr(), i)));
  }
  return out;
}

// Calls f(first, *rest) without building a tuple.
py::object call_with_first(PyObject* f, PyObject* first, PyObject* rest_tuple) {
  const Py_ssize_t n = PyTuple_GET_SIZE(rest_tuple);
  c10::SmallVector<PyObject*, 9> argv(static_cast<size_t>(n) + 2);
  // argv[0] is scratch space for PY_VECTORCALL_ARGUMENTS_OFFSET.
  argv[1] = first;
  for (Py_ssize_t i = 0; i < n; ++i) argv[i + 2] = PyTuple_GET_ITEM(rest_tuple, i);
  return steal(PyObject_Vectorcall(f, argv.data() + 1,
                                   (static_cast<size_t>(n) + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                   nullptr));
}

// Calls f(first, *tensors), None for undefined tensors, without building a
// tuple (one GC-tracked allocation fewer per backward).
py::object call_with_tensors(PyObject* f, PyObject* first, const std::vector<at::Tensor>& ts) {
  c10::SmallVector<PyObject*, 9> argv(ts.size() + 2, nullptr);
  // argv[0] is scratch space for PY_VECTORCALL_ARGUMENTS_OFFSET.
  argv[1] = first;
  struct Release {
    c10::SmallVector<PyObject*, 9>& v;
    ~Release() {
      for (size_t i = 2; i < v.size(); ++i) Py_XDECREF(v[i]);
    }
  } release{argv};
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].defined()) {
      argv[i + 2] = wrap_tensor(ts[i]);
    } else {
      Py_INCREF(Py_None);
      argv[i + 2] = Py_None;
    }
  }
  return steal(PyObject_Vectorcall(f, argv.data() + 1,
                                   (ts.size() + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
}

// Note [Eager context state] for Python Functions: the ctx's attribute dict,
// kept as it is. encode() is kernels.Runner.encode_attrs.
class PyEagerState final : public EagerState {
 public:
  PyEagerState(py::object runner, py::object attrs)
      : runner_(std::move(runner)), attrs_(std::move(attrs)) {}
  ~PyEagerState() override {
    if (!Py_IsInitialized()) {  // the interpreter is gone: leak
      runner_.release();
      attrs_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    runner_ = py::object();
    attrs_ = py::object();
  }
  void encode(std::string& state, std::vector<c10::SymInt>& state_ints,
              std::vector<at::Tensor>& saved) const override {
    py::gil_scoped_acquire gil;
    py::tuple enc = runner_.attr("encode_attrs")(attrs_, saved.size());
    state = enc[0].cast<std::string>();
    state_ints = enc[1].cast<std::vector<c10::SymInt>>();
    for (const at::Tensor& t : tensors_of(enc[2].ptr())) saved.push_back(t);
  }
  PyObject* attrs() const { return attrs_.ptr(); }

 private:
  py::object runner_;
  py::object attrs_;
};

// Note [First call runs forward once]
// The first eager call of a Function learns the op's outputs by running the
// user's forward for real, through call_checked_forward as the kernel does
// (run_first_forward_from_python, called by kernels.Runner.run_first, so the
// in-place check exists once); the op is then defined and
// called, and its kernel takes that result from this slot instead of running
// the forward a second time. The slot belongs to one runner and one
// needs_input_grad; set_primed(None, ...) clears it.
struct Primed {
  py::object runner, out, ctx;
};
thread_local Primed* tls_primed = nullptr;

// The primed (out, ctx) of `runner` for a call with these flags, taken out of
// the slot; false when there is none.
bool take_primed(const py::object& runner, PyObject* needs, py::object* out, py::object* ctx) {
  Primed* p = tls_primed;
  if (p == nullptr || p->runner.ptr() != runner.ptr()) return false;
  tls_primed = nullptr;
  std::unique_ptr<Primed> owned(p);
  py::object flags = p->ctx.attr("needs_input_grad");
  const int same = PyObject_RichCompareBool(flags.ptr(), needs, Py_EQ);
  if (same < 0) throw py::error_already_set();
  if (!same) return false;  // called differently than primed: run the forward
  *out = std::move(p->out);
  *ctx = std::move(p->ctx);
  return true;
}

// What the bridge reads once from a forward runner (the attributes and methods
// it uses are torch_opaque/_impl/bridge.py's ForwardRunnerProtocol).
struct ForwardSpec {
  std::string name;     // the Function's name, for messages
  py::object runner;    // rare paths: convert_args, outputs, encode_ctx
  py::object forward;   // forward(ctx, *args), or forward(*args) with setup_context
  py::object setup;     // setup_context or None
  py::object fn_name;
  py::object no_grad;   // needs_input_grad when the call is not recorded
  size_t n_out;
  bool has_convs;
  // The real kernel keeps ctx attributes as objects (Note [Eager context
  // state]) when the runner's keeps_ctx_objects is true; Python callers that trace the
  // forward get them encoded.
  bool keep_objects = false;
  std::optional<std::vector<Kind>> kinds;
};

// Note [User code sees autograd]
// The op's kernels run below Autograd, but the user's forward and backward
// are Python code that stock PyTorch runs with the full dispatcher: a forward
// under no_grad that may build a graph inside `with torch.enable_grad()` (the
// recompute idiom, reentrant checkpoint), a backward whose grad mode is the
// engine's (create_graph) and which may call torch.autograd.grad or
// .backward() itself (reentrant backward). So while user code runs, the
// Autograd and ADInplaceOrView keys this kernel's caller excluded are
// included again (ADInplaceOrView also makes in-place ops bump versions: Note
// [In-place forwards]), and a forward runs with grad mode and forward-mode AD
// off, as THPFunction_apply runs it. Two exceptions: inference mode keeps its
// own key set, and under a torch.func level (functorch's keys included) the
// transform stack decides (Note [Nested grad]).
struct UserCodeScope {
  explicit UserCodeScope(bool forward) {
    const bool functorch =
        c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
    if (c10::InferenceMode::is_enabled()) return;
    auto tls = c10::impl::tls_local_dispatch_key_set();
    tls.excluded_ = functorch ? tls.excluded_.remove(c10::DispatchKey::ADInplaceOrView)
                              : tls.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
    keys.emplace(tls);
    if (forward && !functorch) {
      grad.emplace(false);
      fw_grad.emplace(false);
    }
  }
  std::optional<c10::impl::ForceDispatchKeyGuard> keys;
  std::optional<at::AutoGradMode> grad;
  std::optional<c10::AutoFwGradMode> fw_grad;
};

// Calls the user's forward with `ctx` on `args` (the values forward expects)
// and returns what it returned, refusing a forward that modified an argument.
py::object call_checked_forward(const ForwardSpec& s, const py::object& args,
                                const py::object& ctx) {
  // Note [In-place forwards]: the user's code runs where ops bump version
  // counters (ADInplaceOrView included: Note [User code sees autograd]), as
  // stock forwards do;
  // an argument whose version changed was modified in place, which an op
  // without a mutable schema must not do. This is the one check: the kernel
  // and the first eager call (run_first_forward_from_python) both run it.
  // (Inference mode keeps its own key set; inference tensors and sparse
  // tensors, which bump versions in some reading ops, are not checked.)
  const bool inference = c10::InferenceMode::is_enabled();
  UserCodeScope as_user_code(/*forward=*/true);
  // (argument index, tensor, version before); list items count as their argument.
  c10::SmallVector<std::tuple<size_t, at::Tensor, uint32_t>, 8> versions;
  auto note = [&](size_t i, PyObject* o) {
    if (!THPVariable_Check(o)) return;
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.layout() == c10::kStrided && !t.is_inference()) {
      versions.emplace_back(i, t, t._version());
    }
  };
  const Py_ssize_t n_args = inference ? 0 : PyTuple_GET_SIZE(args.ptr());
  for (Py_ssize_t i = 0; i < n_args; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args.ptr(), i);
    if (PyList_Check(a) || PyTuple_Check(a)) {
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
      for (Py_ssize_t j = 0; j < m; ++j) note(i, PySequence_Fast_GET_ITEM(a, j));
    } else {
      note(i, a);
    }
  }
  py::object out;
  if (s.setup.is_none()) {
    out = call_with_first(s.forward.ptr(), ctx.ptr(), args.ptr());
  } else {
    out = steal(PyObject_Call(s.forward.ptr(), args.ptr(), nullptr));
    steal(PyObject_CallFunctionObjArgs(s.setup.ptr(), ctx.ptr(), args.ptr(), out.ptr(),
                                       nullptr));
  }
  for (const auto& [i, t, v] : versions) {
    if (t._version() != v) s.runner.attr("raise_modified_input")(i);  // raises
  }
  return out;
}

// Runs the user's forward on `args` (kernel values; converted here) and
// returns what it produced; ctx is read only when `recording`.
detail::ForwardOutcome call_user_forward(const ForwardSpec& s, py::object args,
                                         py::object needs_py, bool recording,
                                         bool keep_objects) {
  py::object ctx;
  py::object out;
  const bool primed =
      s.keep_objects && tls_primed && take_primed(s.runner, needs_py.ptr(), &out, &ctx);
  if (!primed) {  // (primed: Note [First call runs forward once])
    if (s.has_convs) args = s.runner.attr("convert_args")(args);
    ctx = steal(new_forward_context(s.fn_name.ptr(), needs_py.ptr()));
    out = call_checked_forward(s, args, ctx);
  }

  detail::ForwardOutcome outcome;
  auto& outputs = outcome.outputs;
  if (s.n_out == 1 && THPVariable_Check(out.ptr())) {
    outputs.push_back(THPVariable_Unpack(out.ptr()));
  } else {
    bool plain = PyTuple_CheckExact(out.ptr()) &&
        PyTuple_GET_SIZE(out.ptr()) == static_cast<Py_ssize_t>(s.n_out);
    for (size_t k = 0; plain && k < s.n_out; ++k) {
      plain = THPVariable_Check(PyTuple_GET_ITEM(out.ptr(), k));
    }
    // Anything unusual gets the Python check, which raises the right error.
    if (!plain) out = s.runner.attr("outputs")(out);
    outputs = tensors_of(out.ptr());
  }

  if (recording) {
    const ForwardContextView view = view_forward_context(ctx.ptr());
    if (view.has_attributes && keep_objects) {
      outcome.saved = tensors_of(view.to_save);
      outcome.eager_state = std::make_shared<PyEagerState>(
          s.runner, py::reinterpret_borrow<py::object>(view.dict));
    } else if (view.has_attributes) {
      // User attributes: (state, state ints, saved tensors incl. attribute tensors).
      py::tuple enc = s.runner.attr("encode_ctx")(ctx);
      outcome.state = enc[0].cast<std::string>();
      outcome.state_ints = enc[1].cast<std::vector<c10::SymInt>>();
      outcome.saved = tensors_of(enc[2].ptr());
    } else {
      outcome.saved = tensors_of(view.to_save);
    }
    outcome.non_differentiable = tensors_of(view.non_diff);
    outcome.materialize_grads = view.materialize_grads;
  }
  return outcome;
}

void run_forward(ForwardSpec& s, const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  std::optional<std::vector<bool>> needs = take_needs_input_grad();
  const bool recording = needs.has_value();
  py::gil_scoped_acquire gil;
  // `_fwd`'s schema, whose last argument (needs_input_grad) is already popped.
  const size_t n = schema.arguments().size() - 1;
  if (!s.kinds) {
    s.kinds.emplace();
    for (size_t i = 0; i < n; ++i) s.kinds->push_back(kind_of(schema.arguments()[i]));
  }
  c10::SmallVector<c10::IValue, 8> inputs(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
  py::object args = steal(PyTuple_New(static_cast<Py_ssize_t>(n)));
  for (size_t i = 0; i < n; ++i) {
    PyTuple_SET_ITEM(args.ptr(), static_cast<Py_ssize_t>(i), to_python(inputs[i], (*s.kinds)[i]));
  }
  py::object needs_py = recording ? steal(bool_tuple(*needs)) : s.no_grad;
  // Note [Eager state is for nodes] (forward_record.h).
  const bool keep_objects = detail::take_node_takes_record() && s.keep_objects;
  detail::ForwardOutcome outcome =
      call_user_forward(s, std::move(args), needs_py, recording, keep_objects);
  detail::finish_forward(s.name, c10::ArrayRef<c10::IValue>(inputs.data(), inputs.size()),
                         std::move(outcome), recording, stack);
}

// What the bridge reads once from a backward runner (BackwardRunnerProtocol
// in torch_opaque/_impl/bridge.py).
struct BackwardSpec {
  std::string name;
  py::object runner;    // rare paths: decode_ctx, fix_gradient_count, raise_bad_gradients
  py::object backward;  // backward(ctx, *grads)
  py::object fn_name;
  std::vector<bool> tensor_args;
};

PyObject* optional_tensors_tuple(const std::vector<at::Tensor>& ts) {
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(ts.size()));
  if (!t) throw py::error_already_set();
  for (size_t i = 0; i < ts.size(); ++i) {
    PyObject* o;
    if (ts[i].defined()) {
      o = THPVariable_Wrap(ts[i]);
      if (!o) {
        Py_DECREF(t);
        throw py::error_already_set();
      }
    } else {
      Py_INCREF(Py_None);
      o = Py_None;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), o);
  }
  return t;
}

// The user's backward on `_bwd`'s arguments; `eager`: the eager state its
// node passed (Note [Eager context state]), or nullptr.
std::vector<at::Tensor> run_backward(const BackwardSpec& s, BackwardArgs args,
                                     const EagerState* eager) {
  auto& [saved, grads, needs, state, state_ints] = args;
  py::gil_scoped_acquire gil;
  py::object saved_py = steal(optional_tensors_tuple(saved));
  py::object attrs = py::none();
  if (const auto* py_state = dynamic_cast<const PyEagerState*>(eager)) {
    attrs = py::reinterpret_borrow<py::object>(py_state->attrs());
  } else if (!state.empty()) {
    py::tuple dec = s.runner.attr("decode_ctx")(state, saved_py, state_ints);
    saved_py = dec[0];
    attrs = dec[1];
  }
  py::object needs_py = steal(bool_tuple(needs));
  py::object ctx = steal(
      new_backward_context(s.fn_name.ptr(), saved_py.ptr(), needs_py.ptr(), attrs.ptr()));
  py::object res;
  {
    UserCodeScope as_user_code(/*forward=*/false);  // Note [User code sees autograd]
    res = call_with_tensors(s.backward.ptr(), ctx.ptr(), grads);
  }
  if (!PyTuple_Check(res.ptr())) res = steal(PyTuple_Pack(1, res.ptr()));
  const size_t n = s.tensor_args.size();
  if (PyTuple_GET_SIZE(res.ptr()) != static_cast<Py_ssize_t>(n)) {
    res = s.runner.attr("fix_gradient_count")(res);
  }
  std::vector<at::Tensor> result;
  result.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* g = PyTuple_GET_ITEM(res.ptr(), i);
    if (g == Py_None) {
      result.emplace_back();
    } else if (s.tensor_args[i] && THPVariable_Check(g)) {
      result.push_back(THPVariable_Unpack(g));
    } else {
      s.runner.attr("raise_bad_gradients")(res);  // raises
      TORCH_INTERNAL_ASSERT(false, s.name, ": bad gradient ", i, " was not reported");
    }
  }
  return detail::finish_backward(s.name, s.tensor_args, std::move(result), saved, grads);
}

ForwardSpec forward_spec(const py::object& runner) {
  ForwardSpec s;
  s.name = runner.attr("fn_name").cast<std::string>();
  s.fn_name = runner.attr("fn_name");
  s.runner = runner;
  s.forward = runner.attr("forward");
  s.setup = runner.attr("setup_context");
  s.no_grad = runner.attr("no_grad");
  s.n_out = runner.attr("n_out").cast<size_t>();
  s.has_convs = py::len(runner.attr("convs")) > 0;
  return s;
}

BackwardSpec backward_spec(const py::object& runner) {
  BackwardSpec s;
  s.name = runner.attr("fn_name").cast<std::string>();
  s.fn_name = runner.attr("fn_name");
  s.runner = runner;
  s.backward = runner.attr("backward");
  for (py::handle f : runner.attr("tensor_flags")) s.tensor_args.push_back(f.cast<bool>());
  return s;
}

// The tensors of a Python argument, as finish_forward matches them: a tensor,
// a list/tuple of tensors, or nothing.
c10::IValue matchable(PyObject* a) {
  if (THPVariable_Check(a)) return THPVariable_Unpack(a);
  if (PyList_Check(a) || PyTuple_Check(a)) {
    c10::List<at::Tensor> l;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    for (Py_ssize_t j = 0; j < n; ++j) {
      PyObject* e = PySequence_Fast_GET_ITEM(a, j);
      if (!THPVariable_Check(e)) return c10::IValue();
      l.push_back(THPVariable_Unpack(e));
    }
    return l;
  }
  return c10::IValue();
}

} // namespace

PyObject* eager_ctx_attributes(const EagerState* state) {
  const auto* py_state = dynamic_cast<const PyEagerState*>(state);
  return py_state ? py_state->attrs() : nullptr;
}

void set_primed(py::object runner, py::object out, py::object ctx) {
  delete std::exchange(tls_primed, nullptr);
  if (!runner.is_none()) {
    tls_primed = new Primed{std::move(runner), std::move(out), std::move(ctx)};
  }
}

// The specs hold Python objects, so they are deleted with the GIL held. Most
// kernels live for the rest of the process (see all_ops()); those of a
// released op (release_op, called from Python) go when it does. At exit the
// interpreter may be gone: the specs are then left alone.
template <typename Spec>
std::shared_ptr<Spec> python_owned(Spec spec) {
  return std::shared_ptr<Spec>(new Spec(std::move(spec)), [](Spec* p) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    delete p;
  });
}

BoxedKernel make_python_forward(py::object runner) {
  auto s = python_owned(forward_spec(runner));
  // Runners that can encode attributes later (kernels.Runner.encode_attrs)
  // keep them as objects; others (stored programs) encode them now.
  s->keep_objects = runner.attr("keeps_ctx_objects").cast<bool>();
  return [s](const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
    run_forward(*s, schema, stack);
  };
}

DirectBackward make_python_backward(py::object runner) {
  auto s = python_owned(backward_spec(runner));
  return [s](BackwardArgs args, const EagerState* eager) {
    return run_backward(*s, std::move(args), eager);
  };
}

py::tuple run_forward_from_python(py::object runner, py::object forward, py::object setup,
                                  py::object needs, py::tuple args) {
  ForwardSpec s = forward_spec(runner);
  s.forward = std::move(forward);
  s.setup = std::move(setup);
  const bool recording = !needs.is_none();
  std::vector<c10::IValue> inputs;
  inputs.reserve(args.size());
  for (py::handle a : args) inputs.push_back(matchable(a.ptr()));
  detail::ForwardOutcome outcome = call_user_forward(
      s, args, recording ? py::object(py::tuple(needs)) : s.no_grad, recording,
      s.keep_objects);
  torch::jit::Stack stack;
  std::optional<ForwardRecord> record;
  {
    detail::ForwardCallScope scope(std::nullopt);
    detail::finish_forward(s.name, inputs, std::move(outcome), recording, &stack);
    record = scope.take_record();
  }
  py::tuple outs(s.n_out);
  for (size_t k = 0; k < s.n_out; ++k) {
    outs[k] = steal(wrap_tensor(stack[k].toTensor()));
  }
  py::list residuals;
  for (const at::Tensor& t : stack.back().toTensorList().vec()) {
    residuals.append(steal(wrap_tensor(t)));
  }
  py::object rec = record ? py::object(record_to_python(*record)) : py::none();
  return py::make_tuple(outs, residuals, rec);
}

py::tuple run_first_forward_from_python(py::object runner, py::object needs, py::tuple args) {
  ForwardSpec s;  // (the number of outputs is not known yet)
  s.fn_name = runner.attr("fn_name");
  s.runner = runner;
  s.forward = runner.attr("forward");
  s.setup = runner.attr("setup_context");
  py::object ctx = steal(new_forward_context(s.fn_name.ptr(), needs.ptr()));
  at::AutoGradMode no_grad(false);  // forwards run without grad, as under the Autograd kernel
  py::object out = call_checked_forward(s, args, ctx);
  return py::make_tuple(out, ctx);
}

py::list run_backward_from_python(py::object runner, py::object backward, py::object saved,
                                  py::object grads, py::object needs, std::string state,
                                  std::vector<c10::SymInt> state_ints) {
  BackwardSpec s = backward_spec(runner);
  s.backward = std::move(backward);
  auto tensors = [](const py::object& seq) {
    std::vector<at::Tensor> l;
    for (py::handle t : seq) {
      l.push_back(t.is_none() ? at::Tensor() : THPVariable_Unpack(t.ptr()));
    }
    return l;
  };
  BackwardArgs args;
  args.saved = tensors(saved);
  args.grads = tensors(grads);
  for (py::handle b : needs) args.needs_input_grad.push_back(py::cast<bool>(b));
  args.state = std::move(state);
  args.state_ints = std::move(state_ints);
  std::vector<at::Tensor> result = run_backward(s, std::move(args), nullptr);
  py::list out;
  for (const at::Tensor& g : result) {
    out.append(g.defined() ? steal(wrap_tensor(g)) : py::none());
  }
  return out;
}

} // namespace torch_opaque::python
