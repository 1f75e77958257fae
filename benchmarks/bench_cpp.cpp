// bench_cpp: torchmha::MultiheadAttention against LibTorch's torch::nn::MultiheadAttention, both
// from C++, with the same weights, in eval mode under NoGradGuard.
//
//   bench_cpp [JSON_PATH] [cpu|cuda] [REPEATS]
//
// Self-attention on (L, N, E) = (1024, 1, 512), 8 heads. Ours runs with need_weights=false (what a
// model calls it with); LibTorch's module always builds the attention weights, which is exactly
// the cost torchmha avoids. Prints
//   cpp_vs_libtorch ratio=<ours/libtorch> ours_ms=.. libtorch_ms=.. max_abs_diff=..
// and writes the same numbers as JSON to JSON_PATH when one is given (benchmarks/run.py reads it).
// Built by the CMake target bench_cpp (option TORCHMHA_BUILD_BENCHMARKS).

#include <torch/torch.h>
#include <torchmha/torchmha.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kSeqLen = 1024, kBatch = 1, kEmbed = 512, kHeads = 8;
constexpr double kTargetRatio = 0.7;

// Median wall-clock milliseconds of `repeats` calls after `warmup` untimed ones. On CUDA each
// call is followed by a synchronize, so the time covers the kernels and not just their launch.
template <typename Fn>
double median_ms(Fn&& fn, const torch::Device& device, int warmup, int repeats) {
  auto sync = [&] {
    if (device.is_cuda()) {
      torch::cuda::synchronize();
    }
  };
  for (int i = 0; i < warmup; ++i) {
    fn();
  }
  sync();
  std::vector<double> samples;
  samples.reserve(repeats);
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    sync();
    const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
    samples.push_back(elapsed.count());
  }
  std::nth_element(samples.begin(), samples.begin() + repeats / 2, samples.end());
  return samples[repeats / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json_path = argc > 1 ? argv[1] : "";
  const torch::Device device(argc > 2 ? argv[2] : "cpu");
  const int repeats = argc > 3 ? std::max(1, std::atoi(argv[3])) : 30;
  const int warmup = std::max(2, repeats / 5);

  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  torchmha::MultiheadAttention ours(torchmha::MultiheadAttentionOptions(kEmbed, kHeads));
  torch::nn::MultiheadAttention theirs(torch::nn::MultiheadAttentionOptions(kEmbed, kHeads));
  // Non-zero biases (both modules initialise them to zero), so a bias bug shows in the diff.
  ours->in_proj_bias.normal_(0.0, 0.1);
  ours->out_proj->bias.normal_(0.0, 0.1);
  theirs->in_proj_weight.copy_(ours->in_proj_weight);
  theirs->in_proj_bias.copy_(ours->in_proj_bias);
  theirs->out_proj->weight.copy_(ours->out_proj->weight);
  theirs->out_proj->bias.copy_(ours->out_proj->bias);
  ours->to(device);
  theirs->to(device);
  ours->eval();
  theirs->eval();

  const auto x = torch::randn({kSeqLen, kBatch, kEmbed}, torch::TensorOptions().device(device));
  // ->forward rather than operator(): a braced {} cannot pass through the holder's variadic call.
  auto run_ours = [&] {
    return std::get<0>(ours->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/false));
  };
  auto run_theirs = [&] {
    return std::get<0>(theirs->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/false));
  };

  const double max_abs_diff = (run_ours() - run_theirs()).abs().max().item<double>();
  const double ours_ms = median_ms(run_ours, device, warmup, repeats);
  const double libtorch_ms = median_ms(run_theirs, device, warmup, repeats);
  const double ratio = ours_ms / libtorch_ms;

  std::cout << "cpp_vs_libtorch ratio=" << ratio << " ours_ms=" << ours_ms << " libtorch_ms=" << libtorch_ms
            << " max_abs_diff=" << max_abs_diff << " (L=" << kSeqLen << " N=" << kBatch << " E=" << kEmbed
            << " H=" << kHeads << ", " << device << ", median of " << repeats << ", target ratio <= "
            << kTargetRatio << (ratio <= kTargetRatio ? ": PASS" : ": MISS") << ")\n";
  if (!json_path.empty()) {
    std::ofstream json(json_path);
    json << "{\"ratio\": " << ratio << ", \"ours_ms\": " << ours_ms << ", \"libtorch_ms\": " << libtorch_ms
         << ", \"max_abs_diff\": " << max_abs_diff << ", \"target_ratio\": " << kTargetRatio
         << ", \"repeats\": " << repeats << ", \"L\": " << kSeqLen << ", \"N\": " << kBatch
         << ", \"E\": " << kEmbed << ", \"H\": " << kHeads << ", \"device\": \"" << device << "\"}\n";
    if (!json) {
      std::cerr << "bench_cpp: could not write " << json_path << "\n";
      return 1;
    }
  }
  return 0;
}
