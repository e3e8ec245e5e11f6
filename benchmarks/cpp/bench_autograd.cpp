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
// One intra-op thread. At the end a table of per-call medians (CPU time and
// wall time) and the ratio torch_opaque / handwritten is printed.
//
// Run with e.g. --benchmark_repetitions=20 --benchmark_enable_random_interleaving=true
// (see run.sh). On a shared machine prefer the CPU-time column.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

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

void fwd_bwd(benchmark::State& state, OpHandle op, int64_t n) {
  at::Tensor x = torch::randn({n}).requires_grad_();
  at::Tensor g = torch::ones({n});
  for (auto _ : state) {
    at::Tensor y = op.call(x, 2.0);
    torch::autograd::backward({y}, {g});
    benchmark::DoNotOptimize(x.grad().data_ptr());
    x.mutable_grad().reset();
  }
}

void fwd_only(benchmark::State& state, OpHandle op, int64_t n) {
  torch::NoGradGuard no_grad;
  at::Tensor x = torch::randn({n});
  for (auto _ : state) {
    at::Tensor y = op.call(x, 2.0);
    benchmark::DoNotOptimize(y.data_ptr());
  }
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

struct Stat {
  double cpu = 0, real = 0;  // per call, in the benchmark's time unit
  std::string unit;
};

// Console output as usual; keeps the median (or, without repetitions, the
// only) run of each benchmark, and the min across repetitions.
class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  CollectingReporter() : ConsoleReporter(isatty(fileno(stdout)) ? OO_Defaults : OO_Tabular) {}
  std::map<std::string, Stat> median, min;
  int64_t repetitions = 1;

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const std::string name = r.run_name.function_name;
      Stat s{r.GetAdjustedCPUTime(), r.GetAdjustedRealTime(),
             benchmark::GetTimeUnitString(r.time_unit)};
      if (r.run_type == Run::RT_Aggregate) {
        if (r.aggregate_name == "median") median[name] = s;
        if (r.aggregate_name == "min") min[name] = s;
        repetitions = std::max<int64_t>(repetitions, r.repetitions);
      } else if (r.repetitions <= 1) {
        median[name] = min[name] = s;
      }
    }
  }
};

void print_table(const CollectingReporter& rep) {
  std::printf("\nPer-call medians over %lld repetitions (min in brackets); ratio = "
              "torch_opaque / handwritten\n",
              static_cast<long long>(rep.repetitions));
  std::printf("%-9s %5s | %-25s %-25s %6s | %6s %s\n", "case", "size", "handwritten cpu",
              "torch_opaque cpu", "ratio", "ratio", "(wall)");
  bool pass = true;
  int rows = 0;
  for (const char* c : {"fwd_bwd", "fwd_only"}) {
    for (int64_t n : kSizes) {
      const std::string base = std::string(c) + "/" + std::to_string(n) + "/";
      auto h = rep.median.find(base + "handwritten"), o = rep.median.find(base + "torch_opaque");
      if (h == rep.median.end() || o == rep.median.end()) continue;
      auto hm = rep.min.at(base + "handwritten"), om = rep.min.at(base + "torch_opaque");
      const double ratio = o->second.cpu / h->second.cpu;
      const double wall = o->second.real / h->second.real;
      pass &= ratio <= 1.05;
      ++rows;
      char hs[64], os[64];
      std::snprintf(hs, sizeof(hs), "%8.2f %s [%8.2f]", h->second.cpu, h->second.unit.c_str(), hm.cpu);
      std::snprintf(os, sizeof(os), "%8.2f %s [%8.2f]", o->second.cpu, o->second.unit.c_str(), om.cpu);
      std::printf("%-9s %5lld | %-25s %-25s %6.3f | %6.3f %s\n", c, static_cast<long long>(n),
                  hs, os, ratio, wall, ratio <= 1.05 ? "PASS" : "MISS");
    }
  }
  if (rows == 0) {
    std::printf("no handwritten/torch_opaque pair was run\n");
    return;
  }
  std::printf("target torch_opaque/handwritten <= 1.05 (cpu-time medians, all rows): %s\n",
              pass ? "PASS" : "MISS");
}

} // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  check_ops();
  for (const char* c : {"fwd_bwd", "fwd_only"}) {
    for (int64_t n : kSizes) {
      for (const auto& [impl, name] : kImpls) {
        OpHandle op = find_op(name.c_str());
        auto fn = std::string(c) == "fwd_bwd" ? fwd_bwd : fwd_only;
        benchmark::RegisterBenchmark(
            (std::string(c) + "/" + std::to_string(n) + "/" + impl).c_str(),
            [fn, op, n](benchmark::State& s) { fn(s, op, n); })
            ->Unit(benchmark::kMicrosecond)
            ->ComputeStatistics("min", [](const std::vector<double>& v) {
              return *std::min_element(v.begin(), v.end());
            });
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  CollectingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_table(reporter);
  benchmark::Shutdown();
  return 0;
}
