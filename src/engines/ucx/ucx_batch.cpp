// Copyright mstar-kv authors.
//
// UcxReads, the reader's reads (batches, ucx_batch.hpp): starting one (an am request or
// gets), its requests' completions, the epoch checks, failing, aborting and
// finishing it.
#include "ucx_batch.hpp"

#include <cstring>

#include "ucx_core.hpp"
#include "util/stream_copy.hpp"

namespace mstar::kv::ucx {

UcxReads::UcxReads(UcxCore& core) : UcxPart(core, core.cache(), core.options()) {}

std::shared_ptr<Batch> UcxReads::find(std::uint64_t batch_id) const {
  auto it = batches_.find(batch_id);
  return it == batches_.end() ? nullptr : it->second;
}

ReqCtx* UcxReads::new_ctx(std::uint64_t batch_id) {
  auto c = std::make_unique<ReqCtx>();
  c->core = &core_;
  c->batch_id = batch_id;
  return core_.worker().read_requests().add(std::move(c));
}

void UcxReads::fail_batch(std::shared_ptr<Batch> b, Status st) {
  if (!b->failure) b->failure = std::move(st);
  maybe_finish(b);
}

void UcxReads::send_epoch_check(const std::shared_ptr<Batch>& b) {
  const auto& c = b->conn;
  const ReadReqHdr hdr{b->id,          c->served.generation,  0,        kReqCheckOnly,
                       b->check.epoch, b->check.pages.size(), c->ticket};
  core_.worker().send_small(c->ep.get(), kAmReadReq, &hdr, sizeof hdr, b->check.pages.data(),
                            b->check.pages.size() * sizeof(std::uint32_t), true, c->id);
}

void UcxReads::on_fin(const std::shared_ptr<Batch>& b, const Status& st) {
  if (b->aborted || b->failure) return;
  if (!st.is_ok()) {
    fail_batch(b, st);
    return;
  }
  if (!b->get) {
    core_.trace("read %llu: verdict", static_cast<unsigned long long>(b->id));
    b->fin = true;
  } else if (b->get_phase == 0) {
    b->get_phase = 1;
    post_gets(b);
  } else if (b->get_phase == 2) {
    b->get_phase = 3;
  }
  maybe_finish(b);
}

void UcxReads::maybe_finish(std::shared_ptr<Batch> b) {
  if (b->outstanding != 0) return;
  if (b->staged && !b->aborted && !b->failure && !b->staged->status().is_ok()) {
    b->failure = b->staged->status();  // a scatter (or a receive into a buffer) failed
  }
  const bool stopped = b->aborted || b->failure.has_value();
  if (b->staged) {
    // No byte lands after the read resolves: its scatters finish first.
    if (stopped && !core_.staging().staged_idle(*b)) return;
    if (!stopped && !b->staged->finished()) return;
  }
  if (!stopped && !b->pending.empty()) return;
  if (!stopped && b->gather && b->got_count < b->units()) return;
  if (!stopped && b->get && b->next_chunk < b->chunks.size()) return;
  if (!stopped && b->check.epoch != 0) {
    if (!b->get && !b->fin) return;  // the owner's after-send check is to come
    if (b->get && b->get_phase < 2) {
      if (b->get_phase == 1) {  // every get landed: ask again
        b->get_phase = 2;
        send_epoch_check(b);
      }
      return;
    }
    if (b->get && b->get_phase == 2) return;
  }
  if (batches_.erase(b->id) == 0) return;  // finished already
  core_.trace("read %llu: resolved (%s)", static_cast<unsigned long long>(b->id),
              b->failure   ? b->failure->message().c_str()
              : b->aborted ? "aborted"
                           : "ok");
  const auto& c = b->conn;
  c->batches.erase(b->id);
  if (c->closing && c->batches.empty() && c->data_ep) {
    // The last get on a closed connection drained: now its endpoint goes.
    core_.worker().close_ep(std::move(c->data_ep), std::move(c->rkeys), c);
  }
  Status st = b->failure   ? *b->failure
              : b->aborted ? Status(StatusCode::kCancelled, "aborted")
                           : Status::ok();
  auto done = std::move(b->done);
  if (done) done(std::move(st));
}

void UcxReads::request_finished(std::uint64_t batch_id, ucs_status_t st) {
  auto it = batches_.find(batch_id);
  if (it == batches_.end()) return;
  auto b = it->second;
  b->conn->heard = std::chrono::steady_clock::now();
  if (b->outstanding > 0) --b->outstanding;
  core_.trace("read %llu: receive done, %zu outstanding", static_cast<unsigned long long>(batch_id),
              b->outstanding);
  if (st != UCS_OK && !b->failure && !b->aborted) {
    b->failure = Status(StatusCode::kPeerFailure, "ucx request failed: " + ucs_str(st));
  }
  if (b->get) post_gets(b);
  maybe_finish(b);
}

void UcxReads::post_gets(const std::shared_ptr<Batch>& b) {
  const auto& c = b->conn;
  while (b->outstanding < kGetWindow && b->next_chunk < b->chunks.size() && !b->aborted &&
         !b->failure && c->data_ep && !c->closing) {
    const rma::RmaRead& r = b->chunks[b->next_chunk++];
    auto* ctx = new_ctx(b->id);
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    rp.cb.send = trampoline<&UcxReads::on_req_done, RequestGuard>;
    rp.user_data = static_cast<Pending*>(ctx);
    rp.memh = core_.worker().memh_at(r.local_offset);
    // Spans never cross a layer of a cache of one region per layer
    // (planner.hpp): one region, one key each side.
    const std::size_t region =
        c->rkeys.size() == 1 ? 0 : r.remote_offset / c->served.layout.layer_bytes();
    ucs_status_ptr_t sp =
        ucp_get_nbx(c->data_ep.get(), cache_->at(r.local_offset), r.length,
                    c->remote.address(r.remote_offset), c->rkeys[region].get(), &rp);
    if (UCS_PTR_IS_PTR(sp)) {
      ++b->outstanding;
      continue;
    }
    core_.worker().read_requests().take(ctx);
    if (UCS_PTR_IS_ERR(sp)) {
      b->failure = Status(StatusCode::kPeerFailure, "ucp_get_nbx: " + ucs_str(UCS_PTR_STATUS(sp)));
    }
  }
}

void UcxReads::on_req_done(void* request, ucs_status_t st, void* user_data) {
  const Request freed(request);
  auto* ctx = context_of<ReqCtx>(user_data);
  UcxCore* core = ctx->core;
  const std::uint64_t id = ctx->batch_id;
  const std::optional<std::size_t> staged = ctx->staged;
  core->worker().read_requests().take(ctx);
  if (staged) core->staging().staged_received(id, *staged, st);
  core->reads().request_finished(id, st);
}

void UcxReads::on_recv_done(void* request, ucs_status_t st, std::size_t, void* user_data) {
  on_req_done(request, st, user_data);
}

void UcxReads::start_batch(const std::shared_ptr<Batch>& b) {
  const auto& c = b->conn;
  batches_[b->id] = b;
  if (c->closing || !c->ep) {
    fail_batch(b,
               Status(StatusCode::kPeerFailure, "connection to " + c->session_id + " is closed"));
    return;
  }
  // The owner's silence counts from the first read it owes (check_peers).
  if (c->batches.empty()) c->heard = std::chrono::steady_clock::now();
  c->batches.insert(b->id);
  if (c->mode == Mode::kGet) {
    b->get = true;
    if (!b->strided.empty()) {  // gets move rows
      b->chunks =
          split_spans(strided_rows(b->strided, LayerBounds::of(cache_->layout(), c->served.layout)),
                      options_.chunk_bytes);
      b->strided.clear();
    }
    if (b->check.epoch != 0) {  // the gets wait for the owner's first check
      b->get_phase = 0;
      send_epoch_check(b);
      return;
    }
    post_gets(b);
    maybe_finish(b);
    return;
  }
  // Many small spans (rows of a layout change): gathered replies. Staged:
  // always, each message into a host buffer.
  b->gather = core_.staging().active() || !b->strided.empty() || gathers(b->chunks);
  if (core_.staging().active()) {
    try {
      core_.staging().stage_reads(b);
    } catch (const Error& e) {
      fail_batch(b, e.status());
      return;
    }
  }
  if (b->gather) {
    b->got.assign(b->units(), 0);
    std::uint64_t bytes = 0;
    for (const rma::RmaRead& r : b->chunks) bytes += r.length;
    for (const StridedSpan& s : b->strided) bytes += s.bytes();
    b->stream = bytes >= detail::kStreamReadBytes;  // lands with non-temporal stores
  } else {
    for (const rma::RmaRead& r : b->chunks) b->pending.emplace(r.local_offset, r.length);
  }
  const std::uint64_t flags = (c->am_on_data ? kReqEagerOnly | kReqReplyOnData : 0) |
                              (b->gather ? kReqGather : 0) | (b->strided.empty() ? 0 : kReqStrided);
  std::vector<std::uint8_t> body;
  std::size_t nspans = 0;
  auto append = [&body](const auto& wire) {
    if (wire.empty()) return;
    const std::size_t at = body.size();
    body.resize(at + wire.size() * sizeof(wire[0]));
    std::memcpy(body.data() + at, wire.data(), wire.size() * sizeof(wire[0]));
  };
  if (b->strided.empty()) {
    std::vector<WireSpan> wire;
    wire.reserve(b->chunks.size());
    for (const rma::RmaRead& r : b->chunks)
      wire.push_back({r.remote_offset, r.length, r.local_offset});
    nspans = wire.size();
    append(wire);
  } else {
    std::vector<WireStrided> wire;
    wire.reserve(b->strided.size());
    for (const StridedSpan& s : b->strided) {
      wire.push_back(
          {s.remote_offset, s.length, s.local_offset, s.rows, s.remote_stride, s.local_stride});
    }
    nspans = wire.size();
    append(wire);
  }
  const ReadReqHdr hdr{b->id,          c->served.generation,  nspans,   flags,
                       b->check.epoch, b->check.pages.size(), c->ticket};
  append(b->check.pages);
  core_.trace("read %llu: asking", static_cast<unsigned long long>(b->id));
  // Always on the control endpoint, even when the replies come over shared
  // memory (ucx_wire.hpp, BindHdr).
  core_.worker().send_small(c->ep.get(), kAmReadReq, &hdr, sizeof hdr, body.data(), body.size(),
                            true, c->id);
  core_.trace("read %llu: asked %s for %zu spans (flags %llu)",
              static_cast<unsigned long long>(b->id), c->session_id.c_str(), nspans,
              static_cast<unsigned long long>(flags));
}

void UcxReads::abort_batch(std::uint64_t id) {
  auto it = batches_.find(id);
  if (it == batches_.end()) return;
  auto b = it->second;
  b->aborted = true;
  // Stop posting (gets) and drop data still to arrive (am). Requests that
  // write into local pages (at most kGetWindow gets, or rendezvous
  // receives already started) complete by themselves and the read resolves
  // when the last one has; if they have not after kDrainGrace (a hung
  // owner), the progress loop closes the connection by force.
  if (b->outstanding != 0) {
    b->drain_deadline = std::chrono::steady_clock::now() + kDrainGrace;
    draining_.insert(b->id);
  }
  maybe_finish(b);
}

void UcxReads::check_drains() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = draining_.begin(); it != draining_.end();) {
    auto b = batches_.find(*it);
    if (b == batches_.end()) {
      it = draining_.erase(it);
      continue;
    }
    if (now < b->second->drain_deadline) {
      ++it;
      continue;
    }
    auto conn = b->second->conn;
    it = draining_.erase(it);
    core_.reader().close_conn(
        conn,
        Status(StatusCode::kCancelled, "gets of a stopped read did not drain in " +
                                           std::to_string(kDrainGrace.count()) + " ms"),
        true);
  }
}

void UcxReads::abandon() {
  auto left = batches_;
  for (auto& [id, b] : left) {
    b->outstanding = 0;
    fail_batch(b, Status(StatusCode::kShutdown, "the ucx engine shut down"));
  }
}

}  // namespace mstar::kv::ucx
