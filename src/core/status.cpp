// Copyright mstar-kv authors.
#include "mstar/kv/util/status.hpp"

#include <array>
#include <cstddef>

#include "mstar/kv/util/enum_names.hpp"

namespace mstar::kv {

namespace {

constexpr std::array<std::string_view, 16> kStatusCodeNames{"OK",
                                                            "InProgress",
                                                            "RetryLater",
                                                            "InvalidArgument",
                                                            "IncompatibleLayout",
                                                            "CorruptDescriptor",
                                                            "StaleDescriptor",
                                                            "PermissionDenied",
                                                            "NotFound",
                                                            "Unavailable",
                                                            "PeerFailure",
                                                            "Timeout",
                                                            "Cancelled",
                                                            "Shutdown",
                                                            "Internal",
                                                            "NotSupported"};
static_assert(kStatusCodeNames.size() == static_cast<std::size_t>(kLastStatusCode) + 1);

}  // namespace

std::string_view to_string(StatusCode code) noexcept {
  return enum_name(code, kStatusCodeNames, "Unknown");
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
