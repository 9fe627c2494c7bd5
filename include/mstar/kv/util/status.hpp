// Copyright mstar-kv authors.
//
// One error style for the whole library: Status, StatusCode and Error.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace mstar::kv {

// * A bad argument is rejected synchronously, before any byte moves, by
//   throwing mstar::kv::Error.
// * A transfer's outcome travels in its TransferFuture as a Status; get() on a
//   failed future throws the same Error.
// Every message names the offending value and the limit it broke, e.g.
// "remote page 70 out of range [0, 64)".

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInProgress,          // not an error: the transfer is still in flight
  kRetryLater,          // transient: resources busy, the same call may succeed later
  kInvalidArgument,     // caller error: a value outside its limit
  kIncompatibleLayout,  // caller error: the two caches cannot exchange pages
  kCorruptDescriptor,   // untrusted bytes failed to decode
  kStaleDescriptor,     // descriptor from a dead or restarted owner (generation)
  kPermissionDenied,    // memory of another user, or outside a registered region
  kNotFound,            // remote cache / sequence does not exist
  kUnavailable,         // engine not built, or cannot run here (library, device missing)
  kPeerFailure,         // the peer died or became unreachable
  kTimeout,             // the transfer did not finish in its configured time
  kCancelled,           // cancelled by the caller
  kShutdown,            // the engine shut down with the transfer in flight
  kInternal,            // a bug or an unexpected system error
  kNotSupported,        // the engine has no such channel (readiness, done notices)
};
// The last code; a code read from the wire above it is not one of ours.
inline constexpr StatusCode kLastStatusCode = StatusCode::kNotSupported;

// What must be torn down after a failure.
enum class FailureScope : std::uint8_t {
  kNone,      // success, in progress or retry-later
  kTransfer,  // only this transfer failed; engine and peer are fine
  kPeer,      // drop everything cached for this peer (mappings, endpoints)
  kEngine,    // the engine itself is unusable
};

std::string_view to_string(StatusCode code) noexcept;

// Value type: a code plus a human-readable message. Thread-compatible.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool is_ok() const noexcept { return code_ == StatusCode::kOk; }
  StatusCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  FailureScope scope() const noexcept;

  // "Timeout: read of 3 pages from peer 'a' did not finish in 500 ms".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// The exception thrown for synchronous errors (and by TransferFuture::get()).
class Error : public std::runtime_error {
 public:
  explicit Error(Status status);
  Error(StatusCode code, std::string message) : Error(Status(code, std::move(message))) {}

  const Status& status() const noexcept { return status_; }
  StatusCode code() const noexcept { return status_.code(); }

 private:
  Status status_;
};

}  // namespace mstar::kv
