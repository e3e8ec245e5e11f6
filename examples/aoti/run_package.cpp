// Runs an AOTInductor package (package_model.py) from C++, without Python, and
// compares its outputs with the eager ones saved next to it:
//
//   run_package MODEL.pt2 INPUTS.pt EXPECTED.pt [INPUTS2.pt EXPECTED2.pt ...]
//               [--atol A] [--rtol R]
//
// INPUTS.pt and EXPECTED.pt are torch.save'd lists of tensors. Runs the model
// once per pair and prints, for each output, its shape and the max abs
// difference; exits 0 when every output matches (same dtype and shape,
// allclose for floats, equal otherwise), 1 on a mismatch, 2 on bad usage or an
// error (for instance an op the process has not registered).
//
// The compiled model calls the torch_opaque ops (example::scaled_sin,
// example::top_value, ...) through AOTI's proxy executor, which looks them up in
// the dispatcher by name at run time: this program links libexample_ops with
// --no-as-needed so the ops are registered before the package is loaded.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value = torch::jit::pickle_load(bytes);
  std::vector<at::Tensor> out;
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& v : value.toTupleRef().elements()) out.push_back(v.toTensor());
  } else {
    for (const auto& v : value.toListRef()) out.push_back(v.toTensor());
  }
  return out;
}

// Compares one run's outputs with the expected ones; returns whether all match.
bool compare(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& expected,
             double rtol, double atol, double& max_diff_all) {
  bool ok = outputs.size() == expected.size();
  if (!ok) {
    std::cout << "  got " << outputs.size() << " outputs, expected " << expected.size() << "\n";
  }
  for (size_t i = 0; i < std::min(outputs.size(), expected.size()); ++i) {
    const at::Tensor& got = outputs[i];
    const at::Tensor& want = expected[i];
    std::cout << "  output " << i << ": " << got.scalar_type() << got.sizes();
    if (got.scalar_type() != want.scalar_type() || !got.sizes().equals(want.sizes())) {
      std::cout << " MISMATCH: expected " << want.scalar_type() << want.sizes() << "\n";
      ok = false;
      continue;
    }
    double diff = got.numel() == 0
        ? 0.0
        : (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
    max_diff_all = std::max(max_diff_all, diff);
    bool same = at::isFloatingType(got.scalar_type()) || at::isComplexType(got.scalar_type())
        ? at::allclose(got, want, rtol, atol)
        : at::equal(got, want);
    std::cout << " max abs diff " << diff << (same ? "" : " MISMATCH") << "\n";
    ok &= same;
  }
  return ok;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int usage() {
  std::cerr << "usage: run_package MODEL.pt2 INPUTS.pt EXPECTED.pt [INPUTS2.pt EXPECTED2.pt ...]"
               " [--atol A] [--rtol R]\n";
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  std::vector<std::string> paths;
  double atol = 1e-5, rtol = 1.3e-6;  // torch.testing.assert_close's float32 defaults
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--atol" || a == "--rtol") && i + 1 < argc) {
      (a == "--atol" ? atol : rtol) = std::atof(argv[++i]);
    } else if (a.rfind("--", 0) == 0) {
      return usage();
    } else {
      paths.push_back(a);
    }
  }
  if (paths.size() < 3 || paths.size() % 2 == 0) return usage();

  try {
    auto t0 = std::chrono::steady_clock::now();
    torch::inductor::AOTIModelPackageLoader loader(paths[0]);
    std::cout << "loaded " << paths[0] << " in " << seconds_since(t0) << "s\n";

    bool ok = true;
    double max_diff_all = 0;
    for (size_t p = 1; p < paths.size(); p += 2) {
      std::vector<at::Tensor> inputs = load_tensors(paths[p]);
      std::vector<at::Tensor> expected = load_tensors(paths[p + 1]);
      t0 = std::chrono::steady_clock::now();
      std::vector<at::Tensor> outputs = loader.run(inputs);
      std::cout << paths[p] << ": ran in " << seconds_since(t0) << "s\n";
      ok &= compare(outputs, expected, rtol, atol, max_diff_all);
    }
    std::cout << "max abs diff: " << max_diff_all << "\n"
              << (ok ? "aoti package: OK" : "aoti package: MISMATCH") << std::endl;
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
