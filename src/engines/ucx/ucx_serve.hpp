// Copyright mstar-kv authors.
//
// UcxServedReads, the owner's served reads (internal to the ucx engine):
// checking a read's spans (or strided spans) against the region and its
// pages' epochs, grouping them into messages, sending them through a
// window of kSendWindow replies, and the epoch verdict once the last send
// completed. It holds no state of its own between calls: each read's is
// its SendQueue, kept alive by the replies in flight and the continuations
// of the progress thread. Threads: the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/staging.hpp"
#include "ucx_backend.hpp"
#include "ucx_part.hpp"
#include "ucx_state.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

class UcxServedReads : private UcxPart {
 public:
  explicit UcxServedReads(UcxCore& core);

  // A kReqStrided request: validates every span against the region, then
  // serves it as serve_read does, gathering each message's rows from the
  // spans as it goes.
  void serve_strided(const Served& to, const ReadReqHdr& h, const std::vector<WireStrided>& spans,
                     std::vector<std::uint32_t> pages);
  // Serves a read's spans (checked against the region here), or its strided
  // spans (checked by serve_strided; spans is then empty).
  void serve_read(const Served& to, const ReadReqHdr& h, std::vector<CopySpan> spans,
                  std::vector<StridedSpan> strided, std::vector<std::uint32_t> pages);
  Status check_served_epochs(std::uint64_t epoch, const std::vector<std::uint32_t>& pages,
                             const char* when) const;
  // Posts the queue's next replies, up to kSendWindow in flight; one span,
  // or a group of spans as one gathered message (kReqGather).
  void pump(const std::shared_ptr<SendQueue>& q);
  // After ucp_am_send_nbx of ctx: in flight (the callback completes it), or
  // done or failed at once. False when the endpoint failed.
  bool posted(const std::shared_ptr<SendQueue>& q, SendCtx* ctx, ucs_status_ptr_t sp);
  // The body of a data reply's completion (through trampoline<>).
  static void on_data_sent(void* request, ucs_status_t st, void* user_data);

 private:
  // A cache of one region per layer: bytes [first, last] of a served span
  // lie in one layer (always true for one region).
  bool within_one_layer(std::uint64_t first, std::uint64_t last) const noexcept;
  Status crosses_layers(const char* what, std::size_t i, std::uint64_t first,
                        std::uint64_t last) const;
  bool send_span(const std::shared_ptr<SendQueue>& q, const CopySpan& s);
  bool send_gathered(const std::shared_ptr<SendQueue>& q, std::size_t first, std::size_t count);
  // Every send of q completed (or failed): the verdict, and q counted.
  void serve_done(const std::shared_ptr<SendQueue>& q);
};

}  // namespace mstar::kv::ucx
