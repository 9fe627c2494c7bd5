// Copyright mstar-kv authors.
//
// The library's one logging path: a Logger (a threshold plus a sink), carried
// by EngineOptions::log into every engine.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace mstar::kv {

// The library's one logging path. A Logger is a threshold plus a sink,
// carried by EngineOptions::log into every engine (LevelDB's
// Options::info_log). The library writes nothing unless told: the default
// Logger is silent, except that MSTAR_KV_LOG=error|warn|info|debug in the
// environment makes it write at that level to stderr. The CLI logs to stderr
// at warn unless MSTAR_KV_LOG is set. Engines log what a caller cannot see in
// a future: a peer's failure once, with its reason (not once per read),
// resources that could not be released, a backend left unusable.

enum class LogLevel : std::uint8_t { kOff = 0, kError, kWarn, kInfo, kDebug };

// "off", "error", "warn", "info", "debug"; throws Error(kInvalidArgument).
LogLevel parse_log_level(std::string_view name);
std::string_view to_string(LogLevel level) noexcept;

// Value type (copies share the sink). Thread safety: log() is safe from any
// thread if the sink is; the stderr sink writes each line with one call.
class Logger {
 public:
  using Sink = std::function<void(LogLevel level, const std::string& message)>;

  Logger() = default;  // silent
  Logger(LogLevel level, Sink sink);
  // Lines "mstar-kv [warn] message" on stderr.
  static Logger to_stderr(LogLevel level);
  // to_stderr(MSTAR_KV_LOG) when that variable names a level, else silent.
  static Logger from_env();

  bool enabled(LogLevel level) const noexcept {
    return sink_ && level != LogLevel::kOff && level <= level_;
  }
  // Never throws; a sink's exception is dropped.
  void log(LogLevel level, const std::string& message) const noexcept;
  void error(const std::string& m) const noexcept { log(LogLevel::kError, m); }
  void warn(const std::string& m) const noexcept { log(LogLevel::kWarn, m); }
  void info(const std::string& m) const noexcept { log(LogLevel::kInfo, m); }
  void debug(const std::string& m) const noexcept { log(LogLevel::kDebug, m); }

 private:
  LogLevel level_ = LogLevel::kOff;
  std::shared_ptr<const Sink> sink_;
};

}  // namespace mstar::kv
