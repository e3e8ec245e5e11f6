// Trains with an AOTInductor package of a training step (package_step.py),
// from C++ without Python: each run of the package returns the loss and the
// gradients of the parameters, which are the package's constants; the program
// takes SGD steps on them.
//
//   train_step STEP.pt2 DATA.pt [--steps N] [--atol A] [--rtol R]
//
// DATA.pt (torch.save of a dict) holds the inputs, the parameters' names and
// initial values, the learning rate and the reference computed by eager
// PyTorch autograd: the first step's gradients and the loss before each step.
// The program prints the loss of each step and exits 0 when the first step's
// gradients and every loss match the reference (allclose) and the loss falls
// at every step; 1 otherwise; 2 on bad usage or an error (for instance an op
// the process has not registered).
//
// The package calls the train:: ops, their `_fwd`/`_bwd` forms and
// torch_opaque::call_bwd through AOTI's proxy executor, which looks them up in
// the dispatcher by name: this program links libtrain_ops (and with it
// libtorch_opaque) with --no-as-needed so that they are registered.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

c10::Dict<c10::IValue, c10::IValue> load_dict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::jit::pickle_load(bytes).toGenericDict();
}

std::vector<at::Tensor> tensors(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const auto& v : list.toListRef()) out.push_back(v.toTensor());
  return out;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

int usage() {
  std::cerr << "usage: train_step STEP.pt2 DATA.pt [--steps N] [--atol A] [--rtol R]\n";
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  std::vector<std::string> paths;
  double atol = 1e-5, rtol = 1.3e-6;  // torch.testing.assert_close's float32 defaults
  int64_t steps = -1;                 // default: as many as the reference has
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--atol" || a == "--rtol" || a == "--steps") && i + 1 < argc) {
      if (a == "--steps") {
        steps = std::atoi(argv[++i]);
      } else {
        (a == "--atol" ? atol : rtol) = std::atof(argv[++i]);
      }
    } else if (a.rfind("--", 0) == 0) {
      return usage();
    } else {
      paths.push_back(a);
    }
  }
  if (paths.size() != 2) return usage();

  try {
    auto data = load_dict(paths[1]);
    const std::vector<at::Tensor> inputs = tensors(data.at("inputs"));
    std::vector<std::string> names;
    for (const auto& n : data.at("names").toListRef()) names.push_back(n.toStringRef());
    std::vector<at::Tensor> params = tensors(data.at("params"));
    const double lr = data.at("lr").toDouble();
    const std::vector<at::Tensor> want_grads = tensors(data.at("grads"));
    const at::Tensor want_losses = data.at("losses").toTensor();
    if (steps < 0 || steps > want_losses.numel()) steps = want_losses.numel();

    torch::inductor::AOTIModelPackageLoader loader(paths[0]);
    const auto fqns = loader.get_constant_fqns();
    for (const auto& name : names) {
      TORCH_CHECK(std::find(fqns.begin(), fqns.end(), name) != fqns.end(), "the package has no "
                  "constant named ", name, "; it was packaged from another model");
    }

    bool ok = true;
    std::vector<double> losses;
    for (int64_t step = 0; step < steps; ++step) {
      // The parameters are the package's constants: hand it their values.
      std::unordered_map<std::string, at::Tensor> constants;
      for (size_t i = 0; i < names.size(); ++i) constants[names[i]] = params[i];
      loader.load_constants(constants, /*use_inactive=*/false, /*check_full_update=*/true);

      std::vector<at::Tensor> out = loader.run(inputs);  // loss, then one gradient per parameter
      TORCH_CHECK(out.size() == names.size() + 1, "the package returned ", out.size(),
                  " outputs, expected the loss and ", names.size(), " gradients");
      const double loss = out[0].item<double>();
      const double want = want_losses[step].item<double>();
      const bool loss_ok = at::allclose(out[0], want_losses[step], rtol, atol);
      std::cout << "step " << step << ": loss " << loss << " (eager " << want << ")"
                << (loss_ok ? "" : " MISMATCH") << "\n";
      ok &= loss_ok;
      if (step == 0) {
        for (size_t i = 0; i < names.size(); ++i) {
          const bool same_size = out[i + 1].sizes().equals(want_grads[i].sizes());
          const bool same = same_size && at::allclose(out[i + 1], want_grads[i], rtol, atol);
          std::cout << "  grad " << names[i] << out[i + 1].sizes() << ": max abs diff "
                    << (same_size ? max_abs_diff(out[i + 1], want_grads[i]) : -1.0)
                    << (same ? "" : " MISMATCH") << "\n";
          ok &= same;
        }
      }
      if (!losses.empty() && !(loss < losses.back())) {
        std::cout << "  the loss did not fall\n";
        ok = false;
      }
      losses.push_back(loss);
      for (size_t i = 0; i < params.size(); ++i) params[i] = params[i] - lr * out[i + 1];
    }
    std::cout << "loss " << losses.front() << " -> " << losses.back() << " in " << steps
              << " SGD steps\n"
              << (ok ? "train_step: OK" : "train_step: MISMATCH") << std::endl;
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
