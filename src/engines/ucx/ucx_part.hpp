// Copyright mstar-kv authors.
//
// UcxPart (internal to the ucx engine): what every part of UcxCore holds:
// the core that made it (its sibling parts are reached through it), the
// local cache and the engine's options. UcxCore makes each part once,
// after its own cache and options, and outlives it; parts are not copied.
#pragma once

#include <memory>
#include <utility>

#include "ucx_backend.hpp"

namespace mstar::kv::ucx {

class UcxCore;

class UcxPart {
 public:
  UcxPart(const UcxPart&) = delete;
  UcxPart& operator=(const UcxPart&) = delete;

 protected:
  UcxPart(UcxCore& core, std::shared_ptr<KVCache> cache, const UcxOptions& options) noexcept
      : core_(core), cache_(std::move(cache)), options_(options) {}
  ~UcxPart() = default;

  UcxCore& core_;
  const std::shared_ptr<KVCache> cache_;
  const UcxOptions& options_;
};

}  // namespace mstar::kv::ucx
