// Copyright mstar-kv authors.
//
// The one seam a test may put into the ucx engine's progress thread
// (internal to the engine). Product code never makes one: UcxProgress calls
// it only through a pointer that is null unless a test installed it
// (tests/engines/ucx/ucx_test_access.hpp, a friend of UcxProgress).
#pragma once

#include <functional>

namespace mstar::kv::ucx {

class ContinuationSeam {
 public:
  virtual ~ContinuationSeam() = default;
  // [progress] Offered each continuation (UcxProgress::later: an owner's
  // next replies, its verdict); true when the seam keeps `fn` to run it
  // later itself, false to let it run after this round as usual.
  virtual bool hold(std::function<void()>& fn) = 0;
};

}  // namespace mstar::kv::ucx
