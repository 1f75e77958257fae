// The decoding step's attention (decode_attention.h).

#include "decode_attention.h"

#include "common/settings.h"
#include "cpu/kernels.h"

#include <ATen/ATen.h>  // the ops and the tensor operators (<, &, +) on index tensors
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

namespace torchmha::core {

Tensor decode_attention(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                        const OptionalTensor& padding, double dropout_p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::decode_attention", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const OptionalTensor&, const OptionalTensor&, double)>();
  return op.call(q, k_new, v_new, k_cache, v_cache, lengths, new_lengths, padding, dropout_p);
}

// ------------------------------------------------------------------------------ reference
namespace {

// The op's shapes (decode_attention.h), checked before anything is read or written: the CPU
// kernel reads through raw pointers, and the reference would broadcast a (1,) lengths.
void check_step_shapes(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                       const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths) {
  TORCH_CHECK(q.dim() == 4 && k_new.sym_sizes().equals(q.sym_sizes()) && v_new.sym_sizes().equals(q.sym_sizes()),
              "decode_attention: expected q, k_new and v_new of one shape (N, H, T, D), but got ", q.sym_sizes(), ", ",
              k_new.sym_sizes(), " and ", v_new.sym_sizes());
  const auto& N = q.sym_size(0);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sym_sizes().equals(k_cache.sym_sizes()) && k_cache.sym_size(0) == N &&
                  k_cache.sym_size(1) == q.sym_size(1) && k_cache.sym_size(3) == q.sym_size(3),
              "decode_attention: expected k_cache and v_cache of one shape (N, H, M, D) with q's N, H and D ",
              q.sym_sizes(), ", but got ", k_cache.sym_sizes(), " and ", v_cache.sym_sizes());
  for (const auto& [t, name] : {std::pair{OptionalTensor(lengths), "lengths"}, std::pair{new_lengths, "new_lengths"}}) {
    TORCH_CHECK(!is_present(t) || (t->dim() == 1 && t->sym_size(0) == N && t->scalar_type() == at::kLong),
                "decode_attention: expected ", name, " of shape (", N, ",) and dtype int64, but got ", t->sym_sizes(),
                " ", t->scalar_type());
  }
}

// Index (N, T) along the positions of (N, H, *, D) tensors.
Tensor along_positions(const Tensor& index, const Tensor& like) {
  const int64_t N = like.size(0), H = like.size(1), D = like.size(3), T = index.size(1);
  return index.view({N, 1, T, 1}).expand({N, H, T, D});
}

// Writes the new rows where each sequence ends. Without new_lengths every row is new and goes where
// it belongs (one scatter). With it, rows past new_lengths (and any that would fall past the
// capacity) are aimed at a clamped position and carry the value that position must hold after the
// step, so every write to one position writes the same value: the result does not depend on their
// order.
void write_rows(const Tensor& cache, const Tensor& fresh, const Tensor& lengths, const OptionalTensor& new_lengths) {
  const int64_t M = cache.size(2), T = fresh.size(2);
  const Tensor start = lengths.unsqueeze(1);
  const Tensor target = (start + at::arange(T, lengths.options())).clamp_max(M - 1);
  const Tensor index = along_positions(target, cache);
  if (!is_present(new_lengths)) {
    cache.scatter_(2, index, fresh);
    return;
  }
  const Tensor from_fresh = (target >= start) & (target < start + new_lengths->unsqueeze(1));
  const Tensor fresh_row = (target - start).clamp(0, T - 1);
  const Tensor value = at::where(from_fresh.unsqueeze(1).unsqueeze(-1),
                                 fresh.gather(2, along_positions(fresh_row, fresh)), cache.gather(2, index));
  cache.scatter_(2, index, value);
}

// Whether the lengths may be read on the host (filled_length): eager, and no static shapes asked for.
bool lengths_readable(const Tensor& lengths) {
  static const bool static_shapes = settings::read_switch("TORCHMHA_DECODE_STATIC_SHAPES").value_or(false);
  const auto traced = c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                           c10::DispatchKey::PythonTLSSnapshot});
  return !static_shapes && !lengths.is_meta() && (lengths.key_set() & traced).empty();
}

// min(lengths) and max(lengths) in one read (on an accelerator: one sync), where they may be read.
std::optional<std::pair<int64_t, int64_t>> length_range(const Tensor& lengths) {
  if (!lengths_readable(lengths) || lengths.numel() == 0) {
    return std::nullopt;
  }
  const auto [least, greatest] = at::aminmax(lengths);
  const Tensor both = at::stack({least, greatest}).cpu();
  return std::pair{both[0].item<int64_t>(), both[1].item<int64_t>()};
}

// Every sequence holds `length` positions and adds all T rows, with no padding mask: the rows are
// written as one slice, and row t sees the first length + t + 1 keys (no mask at one row). A
// step of the composition in a few kernels, as a hand-written cache does it: on an accelerator
// the composition's step is bound by its launches.
Tensor attend_uniform(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                      const Tensor& v_cache, const Tensor& lengths, int64_t length, double dropout_p) {
  const int64_t M = k_cache.size(2), T = q.size(2);
  TORCH_CHECK(length >= 0 && length + T <= M, "decode_attention: the key/value cache is full: every sequence holds ",
              length, " of its ", M, " positions, and the step adds ", T);
  k_cache.narrow(2, length, T).copy_(k_new);
  v_cache.narrow(2, length, T).copy_(v_new);
  const int64_t keys = length + T;
  const OptionalTensor visible =
      T == 1 ? OptionalTensor() : OptionalTensor(at::ones({T, keys}, q.options().dtype(at::kBool)).tril(length));
  const Tensor out = at::scaled_dot_product_attention(q, k_cache.narrow(2, 0, keys), v_cache.narrow(2, 0, keys),
                                                      visible, dropout_p);
  lengths.add_(T);
  return out;
}

// Any lengths, new_lengths and padding: the rows written where each sequence ends, a mask per
// sequence. `filled` is max(lengths + new_lengths) where the caller read it already.
Tensor attend_general(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                      const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                      const OptionalTensor& padding, double dropout_p, std::optional<int64_t> filled) {
  const int64_t N = k_cache.size(0), M = k_cache.size(2), T = q.size(2);
  const Tensor after = is_present(new_lengths) ? lengths + *new_lengths : lengths + T;  // the lengths after the step
  // The CPU kernel checks these with the numbers; here (any device, no host sync) as assertions.
  if (is_present(new_lengths)) {
    at::_assert_async(((*new_lengths >= 0) & (*new_lengths <= T)).all(),
                      "decode_attention: new_lengths must be in [0, T] (the query's length)");
  }
  at::_assert_async(((lengths >= 0) & (after <= M)).all(), "decode_attention: the key/value cache is full");
  if (is_present(padding)) {
    at::_assert_async(after.le(c10::Scalar(padding->sym_size(1))).all(),  // S may be symbolic
                      "decode_attention: key_padding_mask does not cover every filled cache position");
  }
  write_rows(k_cache, k_new, lengths, new_lengths);
  write_rows(v_cache, v_new, lengths, new_lengths);

  // Eager: only the filled prefix is read (filled_length).
  if (!filled.has_value()) {
    filled = filled_length(after);
  }
  const int64_t keys = filled.has_value() ? std::max<int64_t>(1, *filled) : M;
  const Tensor steps = at::arange(T, lengths.options());
  Tensor last_key = lengths.unsqueeze(1) + steps;  // (N, T)
  OptionalTensor row_is_new;  // (N, T); without new_lengths every row is new
  if (is_present(new_lengths)) {
    row_is_new = steps.unsqueeze(0) < new_lengths->unsqueeze(1);
    // Rows past new_lengths see key 0 only (their result is replaced by zeros), so none is all masked.
    last_key = at::where(*row_is_new, last_key, 0);
  }
  const Tensor visible = at::arange(keys, lengths.options()).view({1, 1, keys}) <= last_key.unsqueeze(2);
  Tensor mask = at::zeros({N, 1, T, keys}, q.options())
                    .masked_fill(visible.logical_not().unsqueeze(1), -std::numeric_limits<double>::infinity());
  if (is_present(padding) && filled.has_value()) {
    mask = mask + padding->narrow(1, 0, keys).view({N, 1, 1, keys});  // S covers every filled position
  } else if (is_present(padding)) {
    const c10::SymInt pad[2] = {0, M - padding->sym_size(1)};  // symbolic S stays symbolic
    mask = mask + at::constant_pad_nd_symint(*padding, pad).view({N, 1, 1, M});
  }
  const Tensor out = at::scaled_dot_product_attention(q, k_cache.narrow(2, 0, keys), v_cache.narrow(2, 0, keys), mask,
                                                      dropout_p);
  lengths.copy_(after);
  return is_present(row_is_new) ? out.masked_fill(row_is_new->logical_not().view({N, 1, T, 1}), 0) : out;
}

}  // namespace

std::optional<int64_t> filled_length(const Tensor& lengths) {
  if (!lengths_readable(lengths)) {
    return std::nullopt;
  }
  return lengths.numel() == 0 ? 0 : lengths.max().item<int64_t>();  // on an accelerator: a sync
}

Tensor decode_attention_reference(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                                  const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                                  const OptionalTensor& padding, double dropout_p) {
  check_step_shapes(q, k_new, v_new, k_cache, v_cache, lengths, new_lengths);
  const int64_t T = q.size(2);
  std::optional<int64_t> filled;
  if (!is_present(new_lengths) && !is_present(padding) && T > 0) {  // every sequence adds every row
    if (const auto range = length_range(lengths)) {
      if (range->first == range->second) {
        return attend_uniform(q, k_new, v_new, k_cache, v_cache, lengths, range->first, dropout_p);
      }
      filled = range->second + T;  // the one read serves the general path too
    }
  }
  return attend_general(q, k_new, v_new, k_cache, v_cache, lengths, new_lengths, padding, dropout_p, filled);
}

Tensor decode_attention_cpu(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const Tensor& k_cache,
                            const Tensor& v_cache, const Tensor& lengths, const OptionalTensor& new_lengths,
                            const OptionalTensor& padding, double dropout_p) {
  check_step_shapes(q, k_new, v_new, k_cache, v_cache, lengths, new_lengths);
  if (auto out = cpu::decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, new_lengths, padding, dropout_p)) {
    return *std::move(out);
  }
  return decode_attention_reference(q, k_new, v_new, k_cache, v_cache, lengths, new_lengths, padding, dropout_p);
}

// ------------------------------------------------------------------------------ fixed keys

Tensor static_attention(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchmha::static_attention", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&)>();
  return op.call(q, keys, values, padding);
}

Tensor static_attention_reference(const Tensor& q, const Tensor& keys, const Tensor& values,
                                  const OptionalTensor& padding) {
  // (SDPA's CPU kernel does not check that keys and values have one length)
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sym_sizes().equals(keys.sym_sizes()) &&
                  keys.sym_size(0) == q.sym_size(0) && keys.sym_size(1) == q.sym_size(1) &&
                  keys.sym_size(3) == q.sym_size(3),
              "static_attention: expected keys and values of one shape (N, H, S, D) with q's N, H and D ",
              q.sym_sizes(), ", but got ", keys.sym_sizes(), " and ", values.sym_sizes());
  TORCH_CHECK(!is_present(padding) || (padding->dim() == 2 && padding->sym_size(0) == q.sym_size(0) &&
                                       padding->sym_size(1) == keys.sym_size(2)),
              "static_attention: expected padding of shape (N, S) = (", q.sym_size(0), ", ", keys.sym_size(2),
              "), but got ", padding->sym_sizes());
  const OptionalTensor mask =
      is_present(padding) ? OptionalTensor(padding->unsqueeze(1).unsqueeze(1)) : std::nullopt;  // (N, 1, 1, S)
  return at::scaled_dot_product_attention(q, keys, values, mask);
}

Tensor static_attention_cpu(const Tensor& q, const Tensor& keys, const Tensor& values, const OptionalTensor& padding) {
  if (auto out = cpu::static_attention(q, keys, values, padding)) {
    return *std::move(out);
  }
  return static_attention_reference(q, keys, values, padding);
}

}  // namespace torchmha::core
