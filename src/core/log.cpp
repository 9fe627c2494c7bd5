// Copyright mstar-kv authors.
#include "mstar/kv/util/log.hpp"

#include <cstdio>
#include <cstdlib>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

LogLevel parse_log_level(std::string_view name) {
  if (name == "off") return LogLevel::kOff;
  if (name == "error") return LogLevel::kError;
  if (name == "warn") return LogLevel::kWarn;
  if (name == "info") return LogLevel::kInfo;
  if (name == "debug") return LogLevel::kDebug;
  throw Error(StatusCode::kInvalidArgument,
              "log level '" + std::string(name) + "' is not one of off, error, warn, info, debug");
}

std::string_view to_string(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::kOff:
      return "off";
    case LogLevel::kError:
      return "error";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kDebug:
      return "debug";
  }
  return "?";
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
