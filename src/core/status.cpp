// Copyright mstar-kv authors.
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

std::string_view to_string(StatusCode code) noexcept {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInProgress:
      return "InProgress";
    case StatusCode::kRetryLater:
      return "RetryLater";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kIncompatibleLayout:
      return "IncompatibleLayout";
    case StatusCode::kCorruptDescriptor:
      return "CorruptDescriptor";
    case StatusCode::kStaleDescriptor:
      return "StaleDescriptor";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kPeerFailure:
      return "PeerFailure";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kShutdown:
      return "Shutdown";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kNotSupported:
      return "NotSupported";
  }
  return "Unknown";
}

FailureScope Status::scope() const noexcept {
  switch (code_) {
    case StatusCode::kOk:
    case StatusCode::kInProgress:
    case StatusCode::kRetryLater:
      return FailureScope::kNone;
    case StatusCode::kInvalidArgument:
    case StatusCode::kIncompatibleLayout:
    case StatusCode::kCorruptDescriptor:
    case StatusCode::kCancelled:
    case StatusCode::kTimeout:
    case StatusCode::kNotSupported:
      return FailureScope::kTransfer;
    case StatusCode::kStaleDescriptor:
    case StatusCode::kPermissionDenied:
    case StatusCode::kNotFound:
    case StatusCode::kPeerFailure:
      return FailureScope::kPeer;
    case StatusCode::kUnavailable:
    case StatusCode::kShutdown:
    case StatusCode::kInternal:
      return FailureScope::kEngine;
  }
  return FailureScope::kEngine;
}

std::string Status::to_string() const {
  std::string out(kv::to_string(code_));
  if (!message_.empty()) {
    out += ": ";
    out += message_;
  }
  return out;
}

Error::Error(Status status) : std::runtime_error(status.to_string()), status_(std::move(status)) {}

}  // namespace mstar::kv
