#pragma once
// The autocast variant of a C++ op (Note [Autocast in the call: C++ ops] in
// csrc/autocast_variant.cpp): def<Op> defines `ns::Name_autocast(<arguments>,
// str autocast_state)` next to `ns::Name`, and Autocast-key kernels on
// `ns::Name` that call it with the state the call was made under.

#include <torch_opaque/opaque_op.h>

#include <ATen/core/ivalue.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_opaque::detail {

// "_autocast": `ns::Name` + it names the variant (as for Python Functions).
extern const char* const kAutocastSuffix;

// One `<device type>:<dtype>` part of an autocast state string.
struct AutocastEntry {
  c10::DeviceType device;
  at::ScalarType dtype;
};

// The parts of `state` ("cpu:torch.bfloat16", ';'-separated). Throws c10::Error
// naming `op_name` for anything that is not a device autocast knows and one of
// the dtypes autocast computes in (torch.float16, torch.bfloat16,
// torch.float32, torch.float64).
std::vector<AutocastEntry> parse_autocast_state(const std::string& state,
                                                const std::string& op_name);

// The state of a call with these arguments: enabled autocast, with its dtype,
// for each device of the call's tensors (sorted by device name, as the Python
// front end writes it); nullopt when autocast is on for none of them.
std::optional<std::string> autocast_state_of_call(c10::ArrayRef<c10::IValue> args);

// Whether a `_fwd` call (`args` without needs_input_grad) runs its forward
// under autocast: autocast on for a device of its tensors, or an autocast
// variant's non-empty state. The debug check of fakes (Note [Debug mode] in
// fake_checks.h) skips those calls: its meta copies do not autocast.
bool runs_under_autocast(const c10::FunctionSchema& fwd_schema, c10::ArrayRef<c10::IValue> args);

// Defines `base`'s variant family (`_autocast`, `_autocast_fwd`,
// `_autocast_bwd`) and the Autocast kernels of `base`'s op. Called by def<Op>
// right after define_op; the Python front end has its own (autocast_variant.py).
std::shared_ptr<OpaqueOp> define_autocast_variant(const std::shared_ptr<OpaqueOp>& base);

} // namespace torch_opaque::detail
