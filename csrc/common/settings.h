#pragma once

// The TORCHMHA_* environment settings that force a kernel choice (docs/kernel_rules.md lists them
// with the rules they override). Each rule reads its setting once per process, in a function-local
// static, at the first call that consults it. A malformed value is a ValueError that names the
// setting, what it takes and what it got; an unset or empty one is "no setting".

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace torchmha::settings {

/// "0" or "1": false or true.
std::optional<bool> read_switch(const char* name);

/// A non-negative integer; `unit` is what it counts ("scores a head"), for the message.
std::optional<int64_t> read_count(const char* name, const char* unit);

/// One of `choices`, exactly as spelled there.
std::optional<std::string> read_choice(const char* name, std::initializer_list<const char*> choices);

}  // namespace torchmha::settings
