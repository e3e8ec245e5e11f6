// Per-call cost of a C++ op written by hand vs with torch_opaque.
//
//   handwritten::scaled_sin   handwritten_scaled_sin.cpp (TORCH_LIBRARY, a
//                             torch::autograd::Function, a backward op)
//   opaque_bench::scaled_sin  opaque_scaled_sin.cpp (TORCH_OPAQUE_DEF)
//
// Both are called through the dispatcher with the same typed handle.
//   fwd_bwd:  x (float, requires_grad) -> y = op(x, 2.0); backward(y, ones);
//             x.grad reset each iteration (so AccumulateGrad always steals).
//   fwd_only: NoGradGuard, x does not require grad -> y = op(x, 2.0).
// One intra-op thread.
//
// Method (as benchmarks/bench_eager.py): per case and size, paired rounds;
// each round times a loop of calls of each op with the CPU time of the calling
// thread (so other processes on a loaded machine count less), in an order
// that alternates from round to round; the ratio torch_opaque / handwritten is
// taken within the round, then the median and the spread (min..max over
// rounds) of those ratios are reported, with the median us/call of each op.
//
//   bench_autograd [--rounds N] [--iters N]   (defaults 15 rounds, 2000 calls
//                                             per op per round at size 16,
//                                             a quarter of that at 4096)
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

namespace {

using OpHandle = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, double)>;

OpHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, double)>();
}

const std::vector<std::pair<std::string, std::string>> kImpls = {
    {"handwritten", "handwritten::scaled_sin"},
    {"torch_opaque", "opaque_bench::scaled_sin"},
};
const std::vector<int64_t> kSizes = {16, 4096};

// A loop of `n` calls.
using Loop = std::function<void(int64_t n)>;

Loop fwd_bwd(OpHandle op, int64_t size) {
  at::Tensor x = torch::randn({size}).requires_grad_();
  at::Tensor g = torch::ones({size});
  return [op, x, g](int64_t n) mutable {
    for (int64_t i = 0; i < n; ++i) {
      at::Tensor y = op.call(x, 2.0);
      torch::autograd::backward({y}, {g});
      x.mutable_grad().reset();
    }
  };
}

Loop fwd_only(OpHandle op, int64_t size) {
  at::Tensor x = torch::randn({size});
  return [op, x](int64_t n) {
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < n; ++i) {
      at::Tensor y = op.call(x, 2.0);
    }
  };
}

// Both ops compute the same values and gradients, and run on meta tensors.
void check_ops() {
  at::Tensor x = torch::randn({16}, torch::kDouble);
  std::vector<at::Tensor> ys, gs;
  for (const auto& [impl, name] : kImpls) {
    at::Tensor xi = x.clone().requires_grad_();
    at::Tensor y = find_op(name.c_str()).call(xi, 2.0);
    y.sum().backward();
    ys.push_back(y.detach());
    gs.push_back(xi.grad());
    at::Tensor m = find_op(name.c_str()).call(torch::empty({3, 5}, torch::kMeta), 2.0);
    TORCH_CHECK(m.is_meta() && m.sizes() == at::IntArrayRef({3, 5}), impl, ": meta call failed");
  }
  TORCH_CHECK(torch::allclose(ys[0], x.sin() * 2) && torch::allclose(ys[1], ys[0]),
              "forward results differ");
  TORCH_CHECK(torch::allclose(gs[0], x.cos() * 2) && torch::allclose(gs[1], gs[0]),
              "gradients differ");
}

double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Row {
  double hand_us, opaque_us, ratio, lo, hi;
};

// Paired rounds of the two loops; round 0 warms up.
Row paired_rounds(Loop& hand, Loop& opaque, int64_t n, int rounds) {
  std::vector<double> th, to, ratios;
  for (int r = 0; r <= rounds; ++r) {
    double t[2] = {0, 0};
    const int64_t k = r == 0 ? std::max<int64_t>(3, n / 5) : n;
    for (int j = 0; j < 2; ++j) {
      const int which = (r + j) % 2;  // the order alternates
      Loop& loop = which == 0 ? hand : opaque;
      const double t0 = thread_seconds();
      loop(k);
      t[which] = (thread_seconds() - t0) / static_cast<double>(k);
    }
    if (r == 0) continue;
    th.push_back(t[0] * 1e6);
    to.push_back(t[1] * 1e6);
    ratios.push_back(t[1] / t[0]);
  }
  return {median(th), median(to), median(ratios),
          *std::min_element(ratios.begin(), ratios.end()),
          *std::max_element(ratios.begin(), ratios.end())};
}

} // namespace

int main(int argc, char** argv) {
  int rounds = 15;
  int64_t iters = 2000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--rounds N] [--iters N]\n", argv[0]);
      return 2;
    }
  }
  at::set_num_threads(1);
  check_ops();
  std::printf("torch_opaque vs hand-written C++ op, float32, 1 thread; %d paired rounds "
              "(thread CPU time, order alternating, ratio within each round)\n\n",
              rounds);
  std::printf("%-9s %5s | %16s %16s | %6s  %-13s\n", "case", "size", "handwritten us",
              "torch_opaque us", "ratio", "spread");
  bool pass = true;
  for (const char* c : {"fwd_bwd", "fwd_only"}) {
    for (int64_t size : kSizes) {
      auto make = std::string(c) == "fwd_bwd" ? fwd_bwd : fwd_only;
      Loop hand = make(find_op(kImpls[0].second.c_str()), size);
      Loop opaque = make(find_op(kImpls[1].second.c_str()), size);
      const int64_t n = size <= 16 ? iters : std::max<int64_t>(20, iters / 4);
      const Row row = paired_rounds(hand, opaque, n, rounds);
      pass &= row.ratio <= 1.05;
      std::printf("%-9s %5lld | %16.2f %16.2f | %5.3fx  [%.3f..%.3f] %s\n", c,
                  static_cast<long long>(size), row.hand_us, row.opaque_us, row.ratio, row.lo,
                  row.hi, row.ratio <= 1.05 ? "PASS" : "MISS");
      std::fflush(stdout);
    }
  }
  std::printf("target torch_opaque/handwritten <= 1.05 (median of per-round ratios, all rows): %s\n",
              pass ? "PASS" : "MISS");
  return 0;
}
