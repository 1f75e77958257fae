// errors.h: where an ArgumentError is thrown, and the translator that may throw something else.

#include <torchmha/errors.h>

#include <atomic>

namespace torchmha::detail {
namespace {
std::atomic<ArgumentErrorTranslator> translator{nullptr};
}  // namespace

void set_argument_error_translator(ArgumentErrorTranslator installed) {
  translator.store(installed);
}

void throw_argument_error(const c10::SourceLocation& where, std::string message) {
  ArgumentError error(where, std::move(message));
  if (auto translate = translator.load()) {
    translate(error);  // throws
  }
  throw error;
}

}  // namespace torchmha::detail
