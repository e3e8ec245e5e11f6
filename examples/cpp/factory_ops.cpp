// An op with no tensor arguments (a factory): the device and dtype come from
// its arguments.
#include <torch_opaque/op.h>

namespace {

// example::scaled_arange(SymInt n, float scale=1., ScalarType? dtype=None,
//                        Device? device=None) -> Tensor: [0, 1, ..., n-1] * scale.
struct ScaledArange {
  static at::Tensor forward(torch_opaque::Context&, c10::SymInt n, double scale,
                            std::optional<at::ScalarType> dtype,
                            std::optional<c10::Device> device) {
    auto options = at::TensorOptions()
                       .dtype(dtype.value_or(at::kFloat))
                       .device(device.value_or(c10::Device(c10::kCPU)));
    return at::arange(at::Scalar(n), options) * scale;
  }
  // Nothing to differentiate.
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor>) {
    return {};
  }
};

} // namespace

TORCH_OPAQUE_DEF(ScaledArange, "example::scaled_arange", "n", "scale=1.", "dtype=None",
                 "device=None");
