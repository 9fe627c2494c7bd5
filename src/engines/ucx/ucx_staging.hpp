// Copyright mstar-kv authors.
//
// UcxStaging, the ucx engine's staging (ucx_staging, core/staging.hpp;
// internal to the engine): when set, a cache the transport cannot touch
// crosses through host buffers. It owns the copier and the lists of what
// waits on a copy; the owner's side (UcxServedReads) and the reader's
// (UcxReads) call it for their messages. Threads: made by UcxCore; active()
// from any thread; the rest on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <memory>
#include <set>
#include <vector>

#include "core/staging.hpp"
#include "ucx_backend.hpp"
#include "ucx_part.hpp"
#include "ucx_state.hpp"

namespace mstar::kv::ucx {

class UcxStaging : private UcxPart {
 public:
  // Picks the copier: a device cache's (Error(kUnavailable) when this build
  // has none, Error(kInvalidArgument) with ucx_staging=off), the host
  // copier with ucx_staging=on, else none; Error(kInvalidArgument) for
  // ucx_mode=get with a copier.
  UcxStaging(UcxCore& core, const std::shared_ptr<KVCache>& cache, const UcxOptions& options);

  bool active() const noexcept { return copier_ != nullptr; }
  // Owner: gives q a pipeline that gathers each of its messages into a
  // host buffer (false, the read refused, when it cannot be made); sends a
  // gathered message.
  bool stage_sends(const std::shared_ptr<SendQueue>& q);
  bool send_staged(const std::shared_ptr<SendQueue>& q, const staging::GatherPipeline::Ready& r);
  // Owner: q's next message is still being gathered (poll() pumps it again).
  void wait_gather(std::shared_ptr<SendQueue> q) { staged_waits_.push_back(std::move(q)); }
  bool gathering() const noexcept { return !staged_waits_.empty(); }
  // Reader: gives b a pipeline that receives its gathered replies into host
  // buffers and scatters them; a reply's arrival (after handle_gather's
  // checks); a rendezvous into a buffer completed.
  void stage_reads(const std::shared_ptr<Batch>& b);
  ucs_status_t staged_arrival(const std::shared_ptr<Batch>& b, const GatherHdr& h, void* data,
                              std::size_t length, bool rndv);
  void staged_received(std::uint64_t batch_id, std::size_t message, ucs_status_t st);
  // Releases what a stopped read holds (its waiting rendezvous); true once
  // no copy of it runs any more.
  bool staged_idle(Batch& b);
  // Every progress round while any is pending: owners' gathers and
  // readers' scatters.
  bool pending() const noexcept { return !staged_waits_.empty() || !staged_reads_.empty(); }
  void poll();

 private:
  // A message's bytes into a buffer.
  void land_staged(const std::shared_ptr<Batch>& b, std::size_t message, staging::Buffer& into,
                   void* data, std::size_t length, bool rndv);

  std::shared_ptr<staging::Copier> copier_;               // null: no staging
  std::vector<std::shared_ptr<SendQueue>> staged_waits_;  // [progress] owner: a gather to finish
  std::set<std::uint64_t> staged_reads_;                  // [progress] reader: reads with copies
};

}  // namespace mstar::kv::ucx
