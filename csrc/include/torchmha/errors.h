#pragma once

// Error kinds of torchmha. torch.nn.MultiheadAttention raises three Python exception types for
// bad input: AssertionError (ranks, shapes, embedding sizes), RuntimeError (attn_mask shapes,
// is_causal without a mask) and ValueError (non-positive sizes). LibTorch maps c10::Error to
// RuntimeError and c10::ValueError to ValueError; ArgumentError below is the third kind, which
// the Python extension translates to AssertionError. All derive from c10::Error, so C++ callers
// catch every torchmha error as they catch any LibTorch error.

#include <torchmha/export.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace torchmha {

/// A malformed argument (wrong rank, shape or embedding size). Python sees AssertionError, the
/// type torch.nn.MultiheadAttention raises for the same input.
class TORCHMHA_API ArgumentError : public c10::Error {
 public:
  using c10::Error::Error;
};

namespace detail {

/// Throws what the installed translator throws for `error`, or `error` itself where none is
/// installed (a C++ program). The Python extension installs one that raises Python's
/// AssertionError at the throw: from torch 2.15 on, torch.ops turns every c10::Error into
/// RuntimeError before pybind11's translators see it, but lets a Python error through.
[[noreturn]] TORCHMHA_API void throw_argument_error(const c10::SourceLocation& where, std::string message);

/// Must throw. Installed once, by the Python extension when it loads.
using ArgumentErrorTranslator = void (*)(const ArgumentError&);
TORCHMHA_API void set_argument_error_translator(ArgumentErrorTranslator translator);

}  // namespace detail
}  // namespace torchmha

/// Throws torchmha::ArgumentError with the concatenated message parts when `cond` is false.
#define TORCHMHA_CHECK_ARG(cond, ...)                                                      \
  do {                                                                                     \
    if (C10_UNLIKELY(!(cond))) {                                                           \
      ::torchmha::detail::throw_argument_error(                                            \
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, ::c10::str(__VA_ARGS__)); \
    }                                                                                      \
  } while (false)
