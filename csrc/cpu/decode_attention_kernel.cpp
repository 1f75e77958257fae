// torchmha's CPU kernel of a decoding step's attention: the cache written, one pass over each
// sequence's filled prefix per head, the lengths advanced (kernels.h; the op's front is
// csrc/core/decode_attention.cpp).

#include "cpu/kernels.h"

#include "common/settings.h"
#include "cpu/cpu_capability.h"
#include "cpu/vec/decode_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace torchmha::cpu {

namespace {

// The step's lengths, read once (they are on the CPU with the data), and checked before anything
// is written, with the numbers.
struct StepLengths {
  std::vector<int64_t> before, added;
};

StepLengths checked_lengths(const Tensor& lengths, const OptionalTensor& new_lengths, int64_t T, int64_t M,
                            const OptionalTensor& padding) {
  const Tensor l = lengths.contiguous();
  StepLengths s{{l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel()}, std::vector<int64_t>(l.numel(), T)};
  if (is_present(new_lengths)) {
    const Tensor n = new_lengths->contiguous();
    s.added.assign(n.data_ptr<int64_t>(), n.data_ptr<int64_t>() + n.numel());
  }
  for (size_t i = 0; i < s.before.size(); ++i) {
    TORCH_CHECK_VALUE(s.added[i] >= 0 && s.added[i] <= T, "new_lengths[", i, "] must be in [0, ", T,
                      "] (the query's length), but got ", s.added[i]);
    TORCH_CHECK(s.before[i] >= 0 && s.before[i] + s.added[i] <= M, "the key/value cache is full: sequence ", i,
                " holds ", s.before[i], " of its ", M, " positions and cannot take ", s.added[i],
                " more; make it with a larger max_length or reset() it");
    TORCH_CHECK(!is_present(padding) || s.before[i] + s.added[i] <= padding->size(1), "key_padding_mask covers ",
                padding->size(1), " cache positions, but sequence ", i, " fills ", s.before[i] + s.added[i]);
  }
  return s;
}

// Below this many bytes of keys (keys x heads x head size x element size) a step runs on the
// calling thread. Counted in bytes, the reads that bound the pass: with 2^16 elements (the rule
// before), float32 took one thread up to 128 keys a step and the cross-attention's 64 memory
// positions; in paired per-step timings of the generation model (one process, AMD EPYC Zen 5),
// 2^16 bytes took 10-60 us off a float32 step at prefix 16-96, 2-54 us off an int8 step (with
// float32 x), and left bfloat16 within its noise (+6 to -41 us).
constexpr int64_t kSerialBytes = int64_t(1) << 16;

// Splits (sequence, head) pairs [0, N * H) into `parts` contiguous ranges of about equal work
// (keys read): sequences at different lengths would leave the threads that hold the short ones
// idle under parallel_for's equal-count split (at batch 8 with lengths prefix/2 .. prefix, the
// longest half holds 60% of the keys). Returns parts + 1 bounds.
std::vector<int64_t> balanced_bounds(const StepLengths& lengths, int64_t H, int64_t parts) {
  const int64_t N = static_cast<int64_t>(lengths.before.size());
  std::vector<int64_t> work(N);  // per pair of sequence n: one row per new position over its prefix
  int64_t total = 0;
  for (int64_t n = 0; n < N; ++n) {
    work[n] = 1 + lengths.added[n] * (lengths.before[n] + lengths.added[n]);
    total += work[n] * H;
  }
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t i = 0; i < N * H && static_cast<int64_t>(bounds.size()) < parts; ++i) {
    done += work[i / H];
    if (done * parts >= total * static_cast<int64_t>(bounds.size())) {
      bounds.push_back(i + 1);
    }
  }
  bounds.resize(parts + 1, N * H);
  return bounds;
}

template <typename scalar_t>
void decode_attention_kernel(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                             const Tensor& v_cache, const StepLengths& lengths, const OptionalTensor& padding,
                             const Tensor& out) {
  const int64_t H = q.size(1), D = q.size(3);
  const kernel::DecodeProblem<scalar_t> problem{
      q.data_ptr<scalar_t>(), k_new.data_ptr<scalar_t>(), v_new.data_ptr<scalar_t>(),
      {q.stride(0), q.stride(1), q.stride(2)}, {k_new.stride(0), k_new.stride(1), k_new.stride(2)},
      k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
      is_present(padding) ? padding->data_ptr<scalar_t>() : nullptr,
      is_present(padding) ? padding->stride(0) : 0, is_present(padding) ? padding->size(1) : 0,
      lengths.before.data(), lengths.added.data(), H, q.size(2), k_cache.size(2), D, 1.0 / std::sqrt(double(D))};
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  const auto run = [&](int64_t begin, int64_t end) {
    avx512 ? kernel::avx512::decode_heads(problem, begin, end) : kernel::avx2::decode_heads(problem, begin, end);
  };
  // A short prefix is cheaper on one thread than the cost of waking the others.
  int64_t keys = 0;
  for (size_t n = 0; n < lengths.before.size(); ++n) {
    keys += lengths.before[n] + lengths.added[n];
  }
  const int64_t pairs = q.size(0) * H;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pairs);
  if (keys * H * D * static_cast<int64_t>(sizeof(scalar_t)) < kSerialBytes || threads <= 1) {
    run(0, pairs);
    return;
  }
  const auto bounds = balanced_bounds(lengths, H, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      run(bounds[part], bounds[part + 1]);
    }
  });
}

// The most new rows a step gives the kernel: any number. Its cost is one pass over the prefix per
// row, and the composition's SDPA runs GEMMs, but the composition also builds a (N, 1, T, keys)
// mask: the kernel measured faster at every size tried (AMD EPYC, avx512f, 2 threads, E=512, H=8;
// float32 and bfloat16): 0.05-0.18x the composition's time for T = 8..128 new rows at prefix 0,
// 0.43-0.85x at prefix 1000, 0.23-0.49x at batch 8 prefix 200, 0.27-0.40x for a whole prefill of
// 256-1024 rows. TORCHMHA_DECODE_KERNEL_MAX_ROWS sets a limit (0: never the kernel).
int64_t kernel_max_rows() {
  static const int64_t rows = settings::read_count("TORCHMHA_DECODE_KERNEL_MAX_ROWS", "new rows a step")
                                  .value_or(std::numeric_limits<int64_t>::max());
  return rows;
}

// The dtypes the kernel reads (bfloat16 and float16 computed in float), on a CPU with its loops.
bool kernel_serves(at::ScalarType dtype) {
  return cpu_capability() != Capability::kNone &&
      (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf);
}

bool kernel_applies(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                    const Tensor& v_cache, const OptionalTensor& padding, double dropout_p) {
  const auto dtype = q.scalar_type();
  if (!kernel_serves(dtype) || dropout_p > 0.0 || q.size(2) > kernel_max_rows()) {
    return false;
  }
  for (const Tensor* t : {&k_new, &v_new, &k_cache, &v_cache}) {
    if (t->scalar_type() != dtype) {
      return false;
    }
  }
  return k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(3) == 1 && k_new.stride(3) == 1 &&
      v_new.stride(3) == 1 && k_new.strides() == v_new.strides() &&
      (!is_present(padding) || (padding->scalar_type() == dtype && padding->stride(1) == 1));
}

// A prefill into empty caches (every sequence at length 0, no padding) of at least this many rows
// runs as causal attention over the new rows through the blocked kernel: query t sees keys 0..t,
// exactly the step's rule when nothing is cached. Against the decode kernel (one pass over the
// prefix per row), float32, (1, 8, T, 64), 3 rounds (AMD EPYC, 2026-12-02): 0.104 against 0.130 ms
// at T = 64, 0.645 against 0.895 at 256, 8.5 against 14.1 at 1024 (SDPA causal: 0.139, 1.19, 12.7).
// TORCHMHA_PREFILL_BLOCKED=0 keeps the decode kernel, 1 takes the blocked kernel from 1 row.
constexpr int64_t kPrefillBlockedRows = 64;

bool prefill_takes_blocked_kernel(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const StepLengths& step,
                                  const OptionalTensor& padding) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_PREFILL_BLOCKED");
  if (forced == false || is_present(padding) || q.size(2) < (forced == true ? 1 : kPrefillBlockedRows) ||
      std::any_of(step.before.begin(), step.before.end(), [](int64_t l) { return l != 0; })) {
    return false;
  }
  return blocked_kernel_applies(q, k_new, v_new, std::nullopt);
}

// The prefill above: each sequence's new rows copied into its cache, causal attention over them,
// and the rows past new_lengths zeroed (they saw only their own garbage keys, which no kept row
// sees: row t reads keys 0..t).
Tensor prefill_blocked(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                       const Tensor& v_cache, const StepLengths& step) {
  const int64_t T = q.size(2);
  // Through the op, as every other call of the blocked kernel (profiles show it as that op).
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::blocked_attention", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                         const OptionalTensor&, bool, bool)>();
  Tensor out =
      std::get<0>(op.call(q, k_new, v_new, std::nullopt, /*is_causal=*/true, /*batch_major=*/false)).contiguous();
  for (int64_t n = 0; n < q.size(0); ++n) {
    const int64_t added = step.added[n];
    k_cache[n].narrow(1, 0, added).copy_(k_new[n].narrow(1, 0, added));
    v_cache[n].narrow(1, 0, added).copy_(v_new[n].narrow(1, 0, added));
    if (added < T) {
      out[n].narrow(1, added, T - added).zero_();
    }
  }
  return out;
}

// Fixed keys (static_attention): no lengths, every (sequence, head) pair the same work.
template <typename scalar_t>
void static_attention_kernel(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding,
                             const Tensor& out) {
  const int64_t H = q.size(1), T = q.size(2), S = keys.size(2), D = q.size(3);
  // (k_new null: the kernel writes nothing, so the keys and values are only read)
  const kernel::DecodeProblem<scalar_t> problem{
      q.data_ptr<scalar_t>(), nullptr, nullptr, {q.stride(0), q.stride(1), q.stride(2)}, {0, 0, 0},
      const_cast<scalar_t*>(keys.const_data_ptr<scalar_t>()), const_cast<scalar_t*>(values.const_data_ptr<scalar_t>()),
      out.data_ptr<scalar_t>(), is_present(padding) ? padding->data_ptr<scalar_t>() : nullptr,
      is_present(padding) ? padding->stride(0) : 0, is_present(padding) ? padding->size(1) : 0, nullptr, nullptr, H, T,
      S, D, 1.0 / std::sqrt(double(D))};
  const bool avx512 = cpu_capability() == Capability::kAvx512;
  const auto run = [&](int64_t begin, int64_t end) {
    avx512 ? kernel::avx512::decode_heads(problem, begin, end) : kernel::avx2::decode_heads(problem, begin, end);
  };
  const int64_t pairs = q.size(0) * H;
  // a pair's work: T rows over S keys of D; at least kSerialBytes of keys a task
  const int64_t pair_bytes = std::max<int64_t>(1, T * S * D * static_cast<int64_t>(sizeof(scalar_t)));
  at::parallel_for(0, pairs, std::max<int64_t>(1, kSerialBytes / pair_bytes), run);
}

bool static_kernel_applies(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding) {
  const auto dtype = q.scalar_type();
  if (!kernel_serves(dtype) || !q.device().is_cpu() || q.dim() != 4 || keys.dim() != 4) {
    return false;
  }
  const int64_t N = q.size(0), H = q.size(1), D = q.size(3), S = keys.size(2);
  const auto same = [&](const Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == at::IntArrayRef{N, H, S, D} &&
        t.is_contiguous();
  };
  return S > 0 && q.stride(3) == 1 && same(keys) && same(values) &&
      (!is_present(padding) || (padding->device().is_cpu() && padding->scalar_type() == dtype &&
                                padding->dim() == 2 && padding->size(0) == N && padding->size(1) == S &&
                                padding->stride(1) == 1));
}

}  // namespace

std::optional<Tensor> decode_attention(const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                                       const OptionalTensor& new_lengths, const OptionalTensor& padding,
                                       double dropout_p) {
  const auto step = checked_lengths(lengths, new_lengths, q.size(2), k_cache.size(2), padding);
  if (!kernel_applies(q, k_new, v_new, k_cache, v_cache, padding, dropout_p)) {
    return std::nullopt;
  }
  Tensor out;
  if (prefill_takes_blocked_kernel(q, k_new, v_new, step, padding)) {
    out = prefill_blocked(q, k_new, v_new, k_cache, v_cache, step);
  } else {
    out = at::empty(q.sizes(), q.options());  // the kernel writes every row, zeros past new_lengths
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_cpu", [&] {
      decode_attention_kernel<scalar_t>(q, k_new, v_new, k_cache, v_cache, step, padding, out);
    });
  }
  int64_t* filled = lengths.data_ptr<int64_t>();
  for (size_t n = 0; n < step.added.size(); ++n) {
    filled[n * lengths.stride(0)] += step.added[n];
  }
  return out;
}

bool decode_attention_into(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                           const Tensor& v_cache, const Tensor& lengths, const Tensor& out) {
  const auto step = checked_lengths(lengths, std::nullopt, q.size(2), k_cache.size(2), std::nullopt);
  if (!kernel_applies(q, k_new, v_new, k_cache, v_cache, std::nullopt, 0.0) ||
      prefill_takes_blocked_kernel(q, k_new, v_new, step, std::nullopt) || !out.is_contiguous() ||
      out.sizes() != q.sizes() || out.scalar_type() != q.scalar_type()) {
    return false;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_cpu", [&] {
    decode_attention_kernel<scalar_t>(q, k_new, v_new, k_cache, v_cache, step, std::nullopt, out);
  });
  return true;
}

bool static_attention_into(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding,
                           const Tensor& out) {
  if (!static_kernel_applies(q, keys, values, padding) || !out.is_contiguous() || out.sizes() != q.sizes() ||
      out.scalar_type() != q.scalar_type()) {
    return false;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "static_attention_cpu", [&] {
    static_attention_kernel<scalar_t>(q, keys, values, padding, out);
  });
  return true;
}

std::optional<Tensor> static_attention(const Tensor& q, const Tensor& keys, const Tensor& values,
                                       const OptionalTensor& padding) {
  if (!static_kernel_applies(q, keys, values, padding)) {
    return std::nullopt;
  }
  Tensor out = at::empty(q.sizes(), q.options());
  static_attention_into(q, keys, values, padding, out);
  return out;
}

bool static_kernel_pays_off(int64_t T, int64_t S) {
  static const std::optional<bool> forced = settings::read_switch("TORCHMHA_STATIC_KERNEL");
  if (forced.has_value()) {
    return *forced;
  }
  return T <= 4 || S <= 64;
}

}  // namespace torchmha::cpu
