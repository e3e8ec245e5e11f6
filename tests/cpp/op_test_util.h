#pragma once
// Helpers shared by the GoogleTest suites that call ops by name.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <functional>
#include <string>
#include <vector>

namespace torch_opaque_test {

// Calls `name` (default overload) through the dispatcher; its first output.
inline at::Tensor call_op(const char* name, std::vector<c10::IValue> args) {
  torch::jit::Stack stack(args.begin(), args.end());
  c10::Dispatcher::singleton().findSchemaOrThrow(name, "").callBoxed(stack);
  return stack[0].toTensor();
}

// The message of the c10::Error `fn` throws ("" when it throws none).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

} // namespace torch_opaque_test
