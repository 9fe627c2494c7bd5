// Copyright mstar-kv authors.
#include "mstar/kv/util/log.hpp"

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>

#include "mstar/kv/util/enum_names.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

constexpr std::array<std::string_view, 5> kLogLevelNames{"off", "error", "warn", "info", "debug"};
static_assert(kLogLevelNames.size() == static_cast<std::size_t>(LogLevel::kDebug) + 1);

}  // namespace

LogLevel parse_log_level(std::string_view name) {
  if (auto level = enum_from_name<LogLevel>(name, kLogLevelNames)) return *level;
  throw Error(StatusCode::kInvalidArgument,
              "log level '" + std::string(name) + "' is not one of off, error, warn, info, debug");
}

std::string_view to_string(LogLevel level) noexcept {
  return enum_name(level, kLogLevelNames, "?");
}

Logger::Logger(LogLevel level, Sink sink)
    : level_(level), sink_(sink ? std::make_shared<const Sink>(std::move(sink)) : nullptr) {}

Logger Logger::to_stderr(LogLevel level) {
  return Logger(level, [](LogLevel l, const std::string& m) {
    const std::string line = "mstar-kv [" + std::string(to_string(l)) + "] " + m + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  });
}

Logger Logger::from_env() {
  const char* v = std::getenv("MSTAR_KV_LOG");
  if (v == nullptr || *v == '\0') return {};
  try {
    return to_stderr(parse_log_level(v));
  } catch (const Error&) {
    return to_stderr(LogLevel::kWarn);  // a typo should not silence warnings
  }
}

void Logger::log(LogLevel level, const std::string& message) const noexcept {
  if (!enabled(level)) return;
  try {
    (*sink_)(level, message);
  } catch (...) {
  }
}

}  // namespace mstar::kv
