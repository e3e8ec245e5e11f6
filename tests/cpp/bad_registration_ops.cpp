// A library whose TORCH_OPAQUE_DEF registrations fail at load time (an
// unqualified name, a name taken twice) next to one that succeeds: loading it
// must not end the process (Note [Static registration errors]).
#include <torch_opaque/op.h>

namespace {
struct Twice {
  static at::Tensor forward(torch_opaque::Context&, const at::Tensor& x) { return x * 2; }
  static std::vector<at::Tensor> backward(torch_opaque::Context&, std::vector<at::Tensor> g) {
    return {g[0] * 2};
  }
};
} // namespace

TORCH_OPAQUE_DEF(Twice, "opaque_bad_registration::twice", "x");
TORCH_OPAQUE_DEF(Twice, "unqualified_twice", "x");
TORCH_OPAQUE_DEF(Twice, "opaque_bad_registration::twice", "x");
