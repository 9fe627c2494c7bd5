// Copyright mstar-kv authors.
//
// What tests reach inside the ucx engine, as a friend of UcxBackend and
// UcxProgress: a hold on the owner's continuations (ContinuationSeam,
// src/engines/ucx/ucx_test_seam.hpp), which the product never installs.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engines/ucx/ucx_backend.hpp"
#include "engines/ucx/ucx_core.hpp"
#include "engines/ucx/ucx_test_seam.hpp"

namespace mstar::kv::ucx {

struct UcxTestAccess {
  // With `on`, an owner's continuations after a data reply completed (its
  // next replies, its verdict) wait until hold(false) lets them go (after
  // that progress round), so that a test can close the reader's connection
  // in between, every time. Runs on the progress thread; false when the
  // engine is stopped.
  static bool hold(UcxBackend& backend, bool on) {
    UcxProgress& p = backend.core_->progress();
    return p.post([&p, on] {
      if (on) {
        if (!p.seam_) p.seam_ = std::make_unique<Hold>();
        return;
      }
      if (!p.seam_) return;
      auto* seam = static_cast<Hold*>(p.seam_.get());
      for (auto& fn : seam->held) p.defer(std::move(fn));
      p.seam_.reset();
    });
  }

 private:
  struct Hold final : ContinuationSeam {
    bool hold(std::function<void()>& fn) override {
      held.push_back(std::move(fn));
      return true;
    }
    std::vector<std::function<void()>> held;  // [progress]
  };
};

}  // namespace mstar::kv::ucx
