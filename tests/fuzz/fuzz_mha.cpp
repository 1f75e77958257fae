// libFuzzer target for torchmha's C++ entry points (make test-fuzz). The input bytes choose the
// shapes, dtypes, options and masks of one call into the functional core, the packed
// in-projection, a cached decoding step (the decode kernel reads raw pointers), or an int8 step of
// a decoder stack (so does the int8 linear kernel); a c10::Error (what Python sees as AssertionError, RuntimeError or ValueError) is an
// accepted answer to bad input. A crash, any other exception, or a sanitizer report is a bug.

#include <torchmha/torchmha.h>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <optional>

namespace {

// Reads the fuzzer's bytes as small choices; past the end every choice is 0.
class Choices {
 public:
  Choices(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  int64_t below(int64_t n) { return pos_ < size_ ? data_[pos_++] % n : 0; }
  bool flag() { return below(2) == 1; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

at::Tensor sequence(int64_t rank, int64_t batch, int64_t length, int64_t features, bool batch_first,
                    at::ScalarType dtype) {
  auto options = at::TensorOptions().dtype(dtype);
  switch (rank) {
    case 2: return at::randn({length, features}, options);
    case 3: return batch_first ? at::randn({batch, length, features}, options) : at::randn({length, batch, features}, options);
    case 4: return at::randn({1, length, batch, features}, options);
    default: return at::randn({features}, options);
  }
}

// None, a bool or float mask of `shape`, an integer mask, or one of a wrong shape.
std::optional<at::Tensor> mask(Choices& c, std::vector<int64_t> shape, at::ScalarType dtype) {
  switch (c.below(6)) {
    case 1: return at::rand(shape) > 0.5;
    case 2: return at::randn(shape, at::TensorOptions().dtype(dtype));
    case 3: return at::zeros(shape, at::kLong);
    case 4:
      shape.push_back(1);
      return at::zeros(shape, at::kBool);
    case 5:
      if (!shape.empty()) shape.back() += 1;
      return at::zeros(shape, at::kBool);
    default: return std::nullopt;
  }
}

void fuzz_one_call(Choices& c) {
  const int64_t heads = 1 + c.below(4);
  const int64_t embed = heads * (1 + c.below(4)) + (c.below(8) == 0 ? 1 : 0);  // sometimes not divisible
  const int64_t N = c.below(4), L = c.below(5), S = c.below(5);
  const int64_t rank = 1 + c.below(4);
  const bool batch_first = c.flag(), separate = c.flag(), bias = c.flag();
  const at::ScalarType dtype = c.below(4) == 0 ? at::kDouble : at::kFloat;
  const at::ScalarType weight_dtype = c.below(8) == 0 ? at::kDouble : at::kFloat;
  const int64_t kdim = separate ? 1 + c.below(6) : embed, vdim = separate ? 1 + c.below(6) : embed;
  const int64_t q_features = embed + (c.below(8) == 0 ? 1 : 0);
  const int64_t v_length = S + (c.below(8) == 0 ? 1 : 0);

  auto query = sequence(rank, N, L, q_features, batch_first, dtype);
  // Self-attention shares one tensor, encoder-decoder shares key and value: identity matters.
  const int64_t sharing = separate ? 2 : c.below(3);
  auto key = sharing == 0 ? query : sequence(rank, N, S, kdim, batch_first, dtype);
  auto value = sharing == 2 ? sequence(rank, N, v_length, vdim, batch_first, dtype) : key;

  auto w = at::TensorOptions().dtype(weight_dtype);
  std::optional<at::Tensor> in_proj_weight, q_w, k_w, v_w, in_proj_bias, bias_k, bias_v;
  if (separate) {
    q_w = at::randn({embed, embed}, w), k_w = at::randn({embed, kdim}, w), v_w = at::randn({embed, vdim}, w);
  } else {
    in_proj_weight = at::randn({3 * embed, embed}, w);
  }
  if (bias) {
    in_proj_bias = at::randn({3 * embed}, w);
  }
  if (c.flag()) {
    bias_k = at::randn({1, 1, embed}, w);
    bias_v = at::randn({1, 1, embed}, w);
  }
  const bool batched = rank == 3;
  auto kpm = mask(c, batched ? std::vector<int64_t>{N, S} : std::vector<int64_t>{S}, dtype);
  auto attn_mask = c.flag() ? mask(c, {N * heads, L, S}, dtype) : mask(c, {L, S}, dtype);
  const bool add_zero_attn = c.flag(), training = c.flag(), need_weights = c.flag(), average = c.flag();
  const bool is_causal = c.flag(), fast_path = c.flag();
  const double dropout = c.below(4) == 0 ? 0.5 : 0.0;

  at::NoGradGuard inference;  // as in serving; also makes the fused fast path reachable
  torchmha::AttentionParameters params;
  params.num_heads = heads;
  params.in_proj_weight = in_proj_weight;
  params.in_proj_bias = in_proj_bias;
  params.q_proj_weight = q_w;
  params.k_proj_weight = k_w;
  params.v_proj_weight = v_w;
  params.bias_k = bias_k;
  params.bias_v = bias_v;
  params.add_zero_attn = add_zero_attn;
  if (c.below(8) == 0) {  // a head size of the caller's (head parallelism), sometimes wrong
    params.head_dim = c.below(4);
  }
  params.out_proj_weight = at::randn({embed, embed}, w);
  params.out_proj_bias = bias ? std::optional<at::Tensor>(at::randn({embed}, w)) : std::nullopt;
  torchmha::AttentionOptions call;
  call.key_padding_mask = kpm;
  call.attn_mask = attn_mask;
  call.need_weights = need_weights;
  call.average_attn_weights = average;
  call.is_causal = is_causal;
  call.training = training;
  call.batch_first = batch_first;
  call.dropout_p = dropout;
  call.allow_fast_path = fast_path;
  torchmha::multi_head_attention_forward(query, key, value, embed, params, call);
}

void fuzz_packed_projection(Choices& c) {
  const int64_t E = c.below(6);
  auto q = at::randn({c.below(4), E});
  auto k = c.flag() ? q : at::randn({c.below(4), E + c.below(2)});
  auto v = c.flag() ? k : at::randn({c.below(4), E});
  auto w = at::randn({3 * E + c.below(2), E + c.below(2)});
  torchmha::in_projection_packed(q, k, v, w, c.flag() ? std::optional<at::Tensor>(at::randn({3 * E})) : std::nullopt);
}

// One cached decoding step: random lengths (some past the capacity), new_lengths (some out of
// range), padding masks, dtypes and cache shapes, through the decode kernel and the ATen
// composition (dropout); sometimes a prefill of 64+ rows into empty caches (the blocked kernel).
void fuzz_cached_step(Choices& c) {
  const bool prefill = c.below(8) == 0;
  const int64_t H = 1 + c.below(3), D = 1 + c.below(5), E = H * D, N = c.below(4);
  const int64_t T = prefill ? 64 + c.below(4) : c.below(8) == 0 ? 9 : c.below(5);
  const int64_t M = prefill ? T - 1 + c.below(3) : 1 + c.below(6);  // a prefill's cache sometimes a row short
  const at::ScalarType dtypes[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};
  const auto options = at::TensorOptions().dtype(dtypes[c.below(4)]);
  const bool batch_first = c.flag();
  auto query = batch_first ? at::randn({N, T, E}, options) : at::randn({T, N, E}, options);
  const int64_t cache_heads = c.below(8) == 0 ? H + 1 : H;  // sometimes a cache for another model
  auto k_cache = at::randn({N, cache_heads, M, D}, options), v_cache = at::randn({N, cache_heads, M, D}, options);
  auto lengths = prefill ? at::zeros({N}, at::kLong) : at::randint(0, M + 2, {N}, at::kLong);
  std::optional<at::Tensor> new_lengths;
  if (c.flag()) {
    new_lengths = at::randint(-1, T + 2, {N}, at::kLong);
  }
  std::optional<at::Tensor> padding;
  if (c.flag()) {
    const int64_t S = c.below(M + 2);
    padding = c.flag() ? at::rand({N, S}) > 0.7 : at::randn({N, S}, options);
  }
  const double dropout = c.below(4) == 0 ? 0.25 : 0.0;
  at::NoGradGuard inference;
  torchmha::AttentionParameters params;
  params.num_heads = H;
  params.in_proj_weight = at::randn({3 * E, E}, options);
  params.in_proj_bias = at::randn({3 * E}, options);
  params.out_proj_weight = at::randn({E, E}, options);
  torchmha::attention_with_cache(query, k_cache, v_cache, lengths, params,
                                 {padding, dropout, /*training=*/dropout > 0, batch_first}, new_lengths);
}

// One int8 step of a 1-layer encoder stack through decoder_step (the int8 linear kernel and the
// kernel step read raw pointers): random rows (past the kernel's 8 sometimes), dtypes, pre- or
// post-norm, scales that sometimes do not fit (missing, a wrong length or dtype, on a slot that is
// not a weight), and caches that sometimes do not fit.
void fuzz_int8_step(Choices& c) {
  const int64_t H = 1 + c.below(3), D = 1 + c.below(9), E = H * D, F = 1 + c.below(40), N = 1 + c.below(3);
  const int64_t T = c.below(8) == 0 ? 9 + c.below(4) : c.below(4), M = T + c.below(3);
  const at::ScalarType dtypes[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};
  const auto options = at::TensorOptions().dtype(dtypes[c.below(4)]);
  c10::List<std::optional<at::Tensor>> params;
  const int64_t shapes[18][2] = {{3 * E, E}, {3 * E, 0}, {E, E}, {E, 0}, {}, {}, {}, {}, {F, E}, {F, 0},
                                 {E, F}, {E, 0}, {E, 0}, {E, 0}, {E, 0}, {E, 0}, {}, {}};
  for (const auto& shape : shapes) {
    params.push_back(shape[0] == 0 ? std::optional<at::Tensor>()
                     : shape[1] == 0 ? at::randn({shape[0]}, options) : at::randn({shape[0], shape[1]}, options));
  }
  params.push_back(std::nullopt);
  params.push_back(std::nullopt);
  auto [weights, scales] = torchmha::decoder_quantize(params);
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights.get(i).has_value()) {
      params.set(i, weights.get(i));
    }
  }
  switch (c.below(8)) {
    case 0: scales.set(c.below(12), std::nullopt); break;
    case 1: scales.set(c.below(12), at::ones({c.below(3 * E + 2)})); break;
    case 2: scales.set(c.below(12), at::ones({E}, at::kDouble)); break;
    default: break;
  }
  // (caches that sometimes do not fit the heads: the kernel step reads them through raw pointers)
  auto keys = at::zeros({1, N, H + (c.below(16) == 0), M, D + (c.below(16) == 0)}, options);
  auto values = c.below(16) == 0 ? at::zeros({1, N, H, M + 1, D}, options) : at::zeros_like(keys);
  const torchmha::DecoderCache cache{keys, values, at::zeros({N}, at::kLong), std::nullopt, std::nullopt, std::nullopt};
  at::NoGradGuard inference;
  torchmha::decoder_step(at::randn({T, N, E + (c.below(8) == 0)}, options), params, cache, H, {"relu"},
                         c10::List<bool>({c.flag()}), {1e-5, 1e-5, 1e-5}, std::nullopt, false, false, std::nullopt,
                         scales);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Choices choices(data, size);
  try {
    switch (choices.below(5)) {
      case 0: fuzz_packed_projection(choices); break;
      case 1: fuzz_cached_step(choices); break;
      case 2: fuzz_int8_step(choices); break;
      default: fuzz_one_call(choices);
    }
  } catch (const c10::Error& e) {
    // Rejected bad input with torchmha's or ATen's error: the expected outcome. An internal
    // assertion (TORCH_INTERNAL_ASSERT) is a bug, not a rejection: crash so libFuzzer keeps the input.
    if (std::strstr(e.what_without_backtrace(), "INTERNAL ASSERT FAILED") != nullptr) {
      std::fprintf(stderr, "internal assertion: %s\n", e.what_without_backtrace());
      std::abort();
    }
  }
  return 0;
}
