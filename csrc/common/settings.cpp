// The TORCHMHA_* settings' parsing (settings.h).

#include "settings.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace torchmha::settings {
namespace {

const char* value_of(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || *value == '\0' ? nullptr : value;
}

}  // namespace

std::optional<bool> read_switch(const char* name) {
  const char* value = value_of(name);
  if (value == nullptr) {
    return std::nullopt;
  }
  const std::string text(value);
  TORCH_CHECK_VALUE(text == "0" || text == "1", name, " must be 0 or 1, but is '", text, "'");
  return text == "1";
}

std::optional<int64_t> read_count(const char* name, const char* unit) {
  const char* value = value_of(name);
  if (value == nullptr) {
    return std::nullopt;
  }
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(end != value && *end == '\0' && parsed >= 0, name, " must be a non-negative integer (", unit,
                    "), but is '", value, "'");
  return static_cast<int64_t>(parsed);
}

std::optional<std::string> read_choice(const char* name, std::initializer_list<const char*> choices) {
  const char* value = value_of(name);
  if (value == nullptr) {
    return std::nullopt;
  }
  std::string listed;
  for (const char* choice : choices) {
    if (std::string(value) == choice) {
      return std::string(value);
    }
    listed += listed.empty() ? choice : std::string(", ") + choice;
  }
  TORCH_CHECK_VALUE(false, name, " must be one of ", listed, ", but is '", value, "'");
}

}  // namespace torchmha::settings
