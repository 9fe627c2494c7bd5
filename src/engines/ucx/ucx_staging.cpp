// Copyright mstar-kv authors.
//
// UcxStaging, staging (ucx_staging, core/staging.hpp): a cache the transport
// cannot touch (device memory; a host cache when asked) crosses through
// host buffers. The wire is unchanged: the owner answers every request with
// the messages a direct owner sends (gathered groups, or single spans),
// each gathered by the cache's copier into a buffer of the read's
// GatherPipeline and sent from there; a staged reader asks for gathered
// replies only and receives each into a buffer of its ScatterPipeline,
// whose copier scatters it into the cache. Copies run beside the wire: a
// pipeline's buffers (kStagingBuffers) hold messages being copied, sent or
// received at once. A read resolves only once none of its copies runs.
#include "ucx_staging.hpp"

#include <cstring>

#include "ucx_core.hpp"

namespace mstar::kv::ucx {

namespace {

// Host buffers per staged read and side: copies of some messages overlap
// the wire time of others. 4 capped 1 MiB messages over tcp (0.72 of a
// direct read), 8 gave 0.78 (bench/results/2026-12-05-ucx-staging.md).
constexpr std::size_t kStagingBuffers = 8;

std::vector<staging::Message> messages_of(
    const std::vector<StridedSpan>& spans,
    const std::vector<std::pair<std::size_t, std::size_t>>& groups) {
  std::vector<staging::Message> out;
  out.reserve(groups.size());
  for (const auto& [first, count] : groups) {
    std::uint64_t bytes = 0;
    for (std::size_t k = 0; k < count; ++k) bytes += spans[first + k].bytes();
    out.push_back({first, count, bytes});
  }
  return out;
}

}  // namespace

UcxStaging::UcxStaging(UcxCore& core, const std::shared_ptr<KVCache>& cache,
                       const UcxOptions& options)
    : UcxPart(core, cache, options) {
  // Staging (ucx_staging): a device cache's bytes cross through host
  // buffers, copied by its memory's copier (the cuda_ipc copy kernel); a
  // host cache only when asked (tests, the cost of staging in the bench).
  if (cache_->memory_kind() == MemoryKind::kDevice) {
    if (options_.staging == Staging::kOff) {
      throw Error(StatusCode::kInvalidArgument,
                  "ucx_staging=off, but the cache is device memory: the ucx engine moves a "
                  "device cache only through host staging (ucx_staging=auto or on)");
    }
    copier_ = cache_->memory().staging_copier();
    if (!copier_) {
      throw Error(StatusCode::kUnavailable,
                  "the ucx engine moves a device cache through pinned host buffers with the "
                  "cuda_ipc engine's copy kernel, which this build lacks (no CUDA compiler, "
                  "or MSTAR_KV_CUDA_IPC_KERNEL=OFF)");
    }
  } else if (options_.staging == Staging::kOn) {
    copier_ = staging::host_copier();
  }
  if (copier_ && options_.mode == Mode::kGet) {
    throw Error(StatusCode::kInvalidArgument,
                "ucx_mode=get cannot fill a staged cache (ucx_staging): its bytes land through "
                "host buffers, never by a get into its pages");
  }
}

// ---- the owner's side ----------------------------------------------------------

bool UcxStaging::stage_sends(const std::shared_ptr<SendQueue>& q) {
  if (q->strided.empty()) {  // spans of one row each
    q->strided.reserve(q->spans.size());
    for (const CopySpan& s : q->spans) {
      q->strided.push_back({s.local_offset, s.remote_offset, s.length, 1, 0, 0});
    }
    if (q->groups.empty()) {  // one message per span (kAmReadData)
      q->staged_data = true;
      q->groups.reserve(q->spans.size());
      for (std::size_t i = 0; i < q->spans.size(); ++i) q->groups.emplace_back(i, 1);
    }
  }
  try {
    q->staged = std::make_unique<staging::GatherPipeline>(copier_, cache_->regions(), q->strided,
                                                          messages_of(q->strided, q->groups),
                                                          kStagingBuffers);
  } catch (const Error& e) {
    core_.owner().send_err(q->ep, q->batch_id, e.status());
    return false;
  }
  return true;
}

bool UcxStaging::send_staged(const std::shared_ptr<SendQueue>& q,
                             const staging::GatherPipeline::Ready& r) {
  auto owned = std::make_unique<SendCtx>();
  owned->core = &core_;
  owned->queue = q;
  owned->bytes = r.bytes;
  owned->staged = r.index;
  SendCtx* ctx = owned.get();
  const auto [first, count] = q->groups[r.index];
  unsigned id = kAmGatherData;
  const void* header = &ctx->gather;
  std::size_t header_length = sizeof ctx->gather;
  if (q->staged_data) {
    ctx->hdr = DataHdr{q->batch_id, q->strided[first].local_offset, r.bytes};
    id = kAmReadData;
    header = &ctx->hdr;
    header_length = sizeof ctx->hdr;
  } else {
    ctx->gather = GatherHdr{q->batch_id, first, count, r.bytes};
  }
  core_.worker().send_requests().add(std::move(owned));
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.flags = (q->flags & kReqEagerOnly) == 0 && r.bytes >= options_.rndv_bytes
                 ? UCP_AM_SEND_FLAG_RNDV
                 : UCP_AM_SEND_FLAG_EAGER;
  rp.cb.send = trampoline<&UcxServedReads::on_data_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  ucs_status_ptr_t sp = ucp_am_send_nbx(q->ep->ep, id, header, header_length, r.data, r.bytes, &rp);
  return core_.serving().posted(q, ctx, sp);
}

// ---- the reader's side ---------------------------------------------------------

void UcxStaging::stage_reads(const std::shared_ptr<Batch>& b) {
  std::vector<StridedSpan> spans = b->strided;
  if (spans.empty()) {
    spans.reserve(b->chunks.size());
    for (const rma::RmaRead& r : b->chunks) {
      spans.push_back({r.local_offset, r.remote_offset, r.length, 1, 0, 0});
    }
  }
  const auto groups = gather_groups(
      spans.size(), [&](std::size_t i) { return spans[i].bytes(); },
      [&](std::size_t i) { return b->strided.empty() ? std::uint64_t{1} : spans[i].rows; });
  b->message_of.assign(spans.size(), 0);
  for (std::size_t m = 0; m < groups.size(); ++m) b->message_of[groups[m].first] = m + 1;
  std::vector<staging::Message> messages = messages_of(spans, groups);
  b->staged = std::make_unique<staging::ScatterPipeline>(
      copier_, cache_->regions(), std::move(spans), std::move(messages), kStagingBuffers);
}

ucs_status_t UcxStaging::staged_arrival(const std::shared_ptr<Batch>& b, const GatherHdr& h,
                                        void* data, std::size_t length, bool rndv) {
  // Untrusted: exactly one of the read's messages (handle_gather checked
  // that its units are the read's, each once, with their bytes).
  const std::size_t m = b->message_of[h.first];
  const bool ok = m != 0 && m - 1 < b->staged->messages() && [&] {
    const staging::Message& want = b->staged->message(m - 1);
    return want.count == h.count && want.bytes == length;
  }();
  if (!ok) {
    core_.reads().fail_batch(
        b, Status(StatusCode::kInternal,
                  "owner sent a gathered reply (spans " + std::to_string(h.first) + "+" +
                      std::to_string(h.count) +
                      ") that the read did not ask for: not one of the messages this "
                      "staged read receives"));
    return UCS_OK;
  }
  staging::Buffer* into = b->staged->receive_into(m - 1);
  if (into != nullptr) {
    land_staged(b, m - 1, *into, data, length, rndv);
    return UCS_OK;
  }
  if (!b->staged->status().is_ok()) {
    core_.reads().fail_batch(b, b->staged->status());
    return UCS_OK;
  }
  // Every buffer busy: the message waits for one (poll_staged). UCX keeps a
  // rendezvous' descriptor until it is received or released; an eager
  // message's bytes are copied.
  staged_reads_.insert(b->id);
  if (rndv) {
    b->waiting.push_back({m - 1, data, {}});
    return UCS_INPROGRESS;
  }
  const auto* p = static_cast<const std::byte*>(data);
  b->waiting.push_back({m - 1, nullptr, std::vector<std::byte>(p, p + length)});
  return UCS_OK;
}

void UcxStaging::land_staged(const std::shared_ptr<Batch>& b, std::size_t message,
                             staging::Buffer& into, void* data, std::size_t length, bool rndv) {
  staged_reads_.insert(b->id);
  if (!rndv) {
    std::memcpy(into.data(), data, length);
    b->staged->received(message);
    b->staged->poll();
    core_.reads().maybe_finish(b);
    return;
  }
  auto* ctx = core_.reads().new_ctx(b->id);
  ctx->staged = message;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = trampoline<&UcxReads::on_recv_done, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  ucs_status_ptr_t sp = ucp_am_recv_data_nbx(core_.worker().get(), data, into.data(), length, &rp);
  if (UCS_PTR_IS_PTR(sp)) {
    ++b->outstanding;
    return;
  }
  core_.worker().read_requests().take(ctx);
  staged_received(b->id, message, UCS_PTR_STATUS(sp));
  if (UCS_PTR_IS_ERR(sp)) {
    core_.reads().fail_batch(b, Status(StatusCode::kPeerFailure,
                                       "ucp_am_recv_data_nbx: " + ucs_str(UCS_PTR_STATUS(sp))));
    return;
  }
  core_.reads().maybe_finish(b);
}

void UcxStaging::staged_received(std::uint64_t batch_id, std::size_t message, ucs_status_t st) {
  const std::shared_ptr<Batch> b = core_.reads().find(batch_id);
  if (!b || !b->staged) return;
  staging::ScatterPipeline& p = *b->staged;
  if (st == UCS_OK) {
    p.received(message);  // its scatter starts (none once the read stopped)
  } else {
    p.lost(message,
           Status(StatusCode::kPeerFailure, "receiving a staged message failed: " + ucs_str(st)));
  }
  p.poll();
}

bool UcxStaging::staged_idle(Batch& b) {
  b.staged->abort();
  for (Batch::Waiting& w : b.waiting) {
    if (w.rndv != nullptr) ucp_am_data_release(core_.worker().get(), w.rndv);
  }
  b.waiting.clear();
  b.staged->poll();
  return b.staged->idle();
}

void UcxStaging::poll() {
  // Owners: queues whose next message was still being gathered.
  auto waits = std::move(staged_waits_);
  staged_waits_.clear();
  for (const auto& q : waits) core_.serving().pump(q);
  // Readers: finished scatters free buffers for waiting messages.
  for (auto it = staged_reads_.begin(); it != staged_reads_.end();) {
    const std::shared_ptr<Batch> b = core_.reads().find(*it);
    if (!b) {
      it = staged_reads_.erase(it);
      continue;
    }
    ++it;
    b->staged->poll();
    while (!b->waiting.empty() && !b->aborted && !b->failure) {
      Batch::Waiting& w = b->waiting.front();
      staging::Buffer* into = b->staged->receive_into(w.message);
      if (into == nullptr) break;
      const Batch::Waiting next = std::move(w);
      b->waiting.pop_front();
      const std::size_t length = b->staged->message(next.message).bytes;
      if (next.rndv != nullptr) {
        land_staged(b, next.message, *into, next.rndv, length, true);
      } else {
        land_staged(b, next.message, *into, const_cast<std::byte*>(next.eager.data()), length,
                    false);
      }
    }
    core_.reads().maybe_finish(b);
  }
}

}  // namespace mstar::kv::ucx
