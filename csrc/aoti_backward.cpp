// torch_opaque::call_bwd: a `Name_bwd` call in a form AOTInductor can package.
//
// Note [Training programs in AOTInductor packages]
// `ns::Name_bwd(Tensor?[] saved, Tensor?[] grads, bool[] needs_input_grad,
// str state, SymInt[] state_ints) -> Tensor?[]` returns one gradient per
// forward argument, None where an argument gets none. AOTInductor runs custom
// ops through its proxy executor, which serializes each call's results: its
// Python half (torch/_inductor/ir.py, FallbackKernel.export_extern_kernel_node)
// and its C++ half (torch/csrc/inductor/aoti_torch/oss_proxy_executor.cpp,
// get_output_info_from_serialized) accept Tensor, Tensor?, Tensor[], int and
// tuples of those, not Tensor?[] ("Unsupported return type ListType"). So a
// training program (torch_opaque.export_training) could not be packaged.
//
// Two ways out were weighed:
// * change `Name_bwd`'s schema (e.g. to a fixed tuple of `Tensor?`): every op
//   then has a different training form, and the archives already written, the
//   ONNX export of training programs, the Python bridge and the C++ finishers
//   all read today's form;
// * rewrite the program before packaging (torch_opaque/aoti.py): each
//   `Name_bwd` call becomes a call of this one op, which calls `Name_bwd` and
//   returns only the gradients the traced call had (the `present` mask, fixed
//   at trace time, as the getitem users of the call are) as a Tensor[].
// The second changes nothing for the other consumers of training programs and
// needs no new op per Function, so it is the one taken. `call_bwd` finds
// `Name_bwd` by name in the dispatcher when it runs, as the proxy executor
// finds every op: a process that runs the package must have registered the
// ops (loaded the library that defines them), and an unknown name is refused
// with that advice. A gradient the program was traced with and that the
// backward no longer returns is an error; a gradient the traced call did not
// have is not used by the program and is dropped.
//
// The proxy executor passes an empty list argument (as_tensors [] / as_ints
// []) as None: it skips list arguments of length zero when it fills the call's
// stack (OSSProxyExecutor::call_function), and a Tensor?[] argument without
// None elements as a Tensor[]. `call_bwd` hands `Name_bwd` the types its schema
// names.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace torch_opaque::detail {
namespace {

// "ns::Name_bwd.overload" ("default", or nothing, for the default overload).
c10::OperatorHandle find_backward(const std::string& qualified) {
  const auto dot = qualified.rfind('.');
  const bool has_overload = dot != std::string::npos && dot > qualified.rfind(':');
  std::string name = has_overload ? qualified.substr(0, dot) : qualified;
  std::string overload = has_overload ? qualified.substr(dot + 1) : "";
  if (overload == "default") overload.clear();
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  TORCH_CHECK(handle.has_value(), "torch_opaque::call_bwd: ", qualified,
              " is not a registered op. Load the library that defines it (for a C++ op, link "
              "its ops library; from Python, torch_opaque.load_library) before running the "
              "program.");
  const auto& returns = handle->schema().returns();
  TORCH_CHECK(name.size() > 4 && name.compare(name.size() - 4, 4, "_bwd") == 0 &&
                  returns.size() == 1 &&
                  returns[0].type()->isSubtypeOf(*c10::ListType::ofOptionalTensors()),
              "torch_opaque::call_bwd: ", qualified,
              " is not the backward (`Name_bwd`) of a torch_opaque op.");
  return *handle;
}

// A Tensor?[] argument as `Name_bwd` reads it. The proxy executor passes a
// list of tensors serialized as `as_tensors` as a Tensor[] (and an empty one
// as None).
c10::List<std::optional<at::Tensor>> optional_tensors(const c10::IValue& v) {
  c10::List<std::optional<at::Tensor>> out;
  if (v.isNone()) return out;
  for (const c10::IValue& e : v.toListRef()) {
    out.push_back(e.isNone() ? std::nullopt : std::optional<at::Tensor>(e.toTensor()));
  }
  return out;
}

c10::IValue list_or_empty(c10::IValue v, c10::IValue empty) {
  return v.isNone() ? std::move(empty) : std::move(v);
}

// call_bwd(str op, bool[] present, Tensor?[] saved, Tensor?[] grads,
//          bool[] needs_input_grad, str state, SymInt[] state_ints) -> Tensor[]
void call_bwd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::pop(*stack, 7);
  const std::string qualified = args[0].toStringRef();
  const std::vector<bool> present = args[1].isNone() ? std::vector<bool>{}
                                                     : args[1].toBoolList().vec();
  auto backward = find_backward(qualified);

  stack->push_back(optional_tensors(args[2]));
  stack->push_back(optional_tensors(args[3]));
  stack->push_back(list_or_empty(std::move(args[4]), c10::List<bool>()));
  stack->push_back(std::move(args[5]));
  stack->push_back(list_or_empty(std::move(args[6]), c10::List<int64_t>()));
  backward.callBoxed(stack);

  const c10::IValue result = torch::jit::pop(*stack);
  const auto grads = result.toListRef();
  TORCH_CHECK(grads.size() == present.size(), "torch_opaque::call_bwd: ", qualified,
              " returned ", grads.size(), " gradients, but the program was traced with ",
              present.size(), ".");
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!present[i]) continue;
    TORCH_CHECK(grads[i].isTensor() && grads[i].toTensor().defined(),
                "torch_opaque::call_bwd: ", qualified, " returned no gradient for argument ",
                i, ", which the program was traced with and uses.");
    out.push_back(grads[i].toTensor());
  }
  stack->emplace_back(std::move(out));
}

} // namespace
} // namespace torch_opaque::detail

TORCH_LIBRARY_FRAGMENT(torch_opaque, m) {
  m.def("call_bwd(str op, bool[] present, Tensor?[] saved, Tensor?[] grads, "
        "bool[] needs_input_grad, str state, SymInt[] state_ints) -> Tensor[]",
        {at::Tag::pt2_compliant_tag});
  m.impl("call_bwd",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                         torch::CppFunction::makeFromBoxedFunction<
                             &torch_opaque::detail::call_bwd>()));
}
