// Loaded by tests/test_cpp_list_ops_compiled.py, built twice: one op name
// whose backward gives the Tensor[] elements no gradient
// (TORCH_OPAQUE_TEST_LIST_GRADIENTS=0) or their gradients (=1), as a library
// before and after its author fixed it (Note [Compile caches and C++
// libraries] in torch_opaque/_impl/cpp_fakes.py).
#include <torch_opaque/op.h>

namespace {

struct WeightedSum {
  static at::Tensor forward(torch_opaque::Context& ctx, const std::vector<at::Tensor>& xs,
                            const at::Tensor& w) {
    at::Tensor out = at::zeros_like(xs[0]);
    for (size_t i = 0; i < xs.size(); ++i) out = out + xs[i] * w[i];
    std::vector<at::Tensor> saved(xs.begin(), xs.end());
    saved.push_back(w);
    ctx.save_for_backward(saved);
    return out;
  }
  static std::vector<torch_opaque::Gradient> backward(torch_opaque::Context& ctx,
                                                      std::vector<at::Tensor> grads) {
    std::vector<at::Tensor> saved = ctx.saved_tensors();
    const at::Tensor w = saved.back();
    saved.pop_back();
    std::vector<at::Tensor> gxs, gw;
    for (size_t i = 0; i < saved.size(); ++i) {
      if (TORCH_OPAQUE_TEST_LIST_GRADIENTS) gxs.push_back(grads[0] * w[i]);
      gw.push_back((grads[0] * saved[i]).sum());
    }
    return {gxs, at::stack(gw)};
  }
};

} // namespace

TORCH_OPAQUE_DEF(WeightedSum, "opaque_rebuilt_test::weighted_sum", "xs", "w");
