// Copyright mstar-kv authors.
//
// Active messages: UcxCore's dispatch to the side each id is for, the
// owner's and the reader's handlers, and the reader's data arrival
// (UcxReads).
#include <cstring>

#include "ucx_core.hpp"

namespace mstar::kv::ucx {

// ---- active messages -------------------------------------------------------

ucs_status_t UcxCore::on_am(void* arg, const void* header, std::size_t header_length, void* data,
                            std::size_t length, const ucp_am_recv_param_t* param) {
  auto* tag = static_cast<AmTag*>(arg);
  UcxCore& core = *tag->core;
  switch (tag->id) {
    case kAmHello:
    case kAmAuth:
    case kAmReadReq:
    case kAmDone:
    case kAmReadyReq:
    case kAmPing:
    case kAmBind:
      return core.owner_.handle_am(tag->id, header, header_length, data, length, param);
    case kAmReadData:
    case kAmGatherData:
    case kAmReadErr:
    case kAmReadFin:
      return core.reads_.handle_am(tag->id, header, header_length, data, length, param);
    default:
      return core.reader_.handle_am(tag->id, header, header_length, data, length, param);
  }
}

ucs_status_t UcxOwner::handle_am(unsigned id, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool has_reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
  switch (id) {
    case kAmHello: {
      if (header_length != sizeof(HelloHdr) || !has_reply_ep || rndv) return UCS_OK;
      HelloHdr h;
      std::memcpy(&h, header, sizeof h);
      Served to = served_of(param->reply_ep);
      if (to) core_.progress().defer([this, to, h] { on_hello(to, h); });
      return UCS_OK;
    }
    case kAmAuth: {
      if (header_length != sizeof(AuthHdr) || !has_reply_ep || rndv) return UCS_OK;
      AuthHdr h;
      std::memcpy(&h, header, sizeof h);
      Served to = served_of(param->reply_ep);
      if (to) core_.progress().defer([this, to, h] { on_auth(to, h); });
      return UCS_OK;
    }
    case kAmReadReq: {
      if (header_length != sizeof(ReadReqHdr) || !has_reply_ep || rndv) return UCS_OK;
      ReadReqHdr h;
      std::memcpy(&h, header, sizeof h);
      // Every answer goes through the record of the reader's connection
      // (ServedEp), never through the bare endpoint.
      Served to = served_of(param->reply_ep);
      if (!to) {  // not on a listener endpoint: nobody to answer
        counters_.refused.fetch_add(1, std::memory_order_relaxed);
        return UCS_OK;
      }
      if ((h.flags & kReqReplyOnData) != 0) {
        if (to->data_reply == nullptr) {
          core_.progress().defer([this, to, h] {
            send_err(to, h.batch_id,
                     Status(StatusCode::kInvalidArgument,
                            "a read request for replies on a data endpoint this connection did "
                            "not bind (kAmBind)"));
          });
          return UCS_OK;
        }
        auto bound = std::make_shared<ServedEp>();
        bound->ep = to->data_reply;
        bound->conn = to;
        to = std::move(bound);
      }
      const bool check_only = (h.flags & kReqCheckOnly) != 0;
      const bool strided = (h.flags & kReqStrided) != 0;
      const std::size_t span_bytes = strided ? sizeof(WireStrided) : sizeof(WireSpan);
      // Untrusted: the counts must match the length exactly, pages only
      // come with an epoch, a check-only request has no spans, strided
      // spans come gathered.
      if ((check_only ? h.nspans != 0 : (h.nspans == 0 || h.nspans > kMaxSpansPerRequest)) ||
          h.npages > kMaxSpansPerRequest || (h.epoch == 0 && (h.npages != 0 || check_only)) ||
          (strided && (check_only || (h.flags & kReqGather) == 0)) ||
          length != h.nspans * span_bytes + h.npages * sizeof(std::uint32_t)) {
        core_.progress().defer([this, to, h] {
          send_err(to, h.batch_id, Status(StatusCode::kInvalidArgument, "malformed read request"));
        });
        return UCS_OK;
      }
      if (!ticket_valid(h.ticket)) {
        core_.progress().defer([this, to, h] {
          send_err(to, h.batch_id,
                   Status(StatusCode::kPermissionDenied,
                          "read request without the ticket of an authenticated connection"));
        });
        return UCS_OK;
      }
      std::vector<std::uint32_t> pages(h.npages);
      if (h.npages) {
        std::memcpy(pages.data(), static_cast<const std::byte*>(data) + h.nspans * span_bytes,
                    h.npages * sizeof(std::uint32_t));
      }
      if (strided) {
        std::vector<WireStrided> spans(h.nspans);
        std::memcpy(spans.data(), data, h.nspans * sizeof(WireStrided));
        core_.progress().defer([this, to, h, s = std::move(spans), p = std::move(pages)]() mutable {
          core_.serving().serve_strided(to, h, s, std::move(p));
        });
        return UCS_OK;
      }
      if (check_only) {
        core_.progress().defer([this, to, h, p = std::move(pages)] {
          Status st = core_.serving().check_served_epochs(h.epoch, p, "around the gets");
          const ErrHdr fin{h.batch_id, static_cast<std::uint32_t>(st.code()), 0};
          reply(to, kAmReadFin, &fin, sizeof fin, st.message().data(), st.message().size());
        });
        return UCS_OK;
      }
      // The rows as the planner writes them, checked by serve_read.
      std::vector<CopySpan> rows(h.nspans);
      for (std::size_t i = 0; i < h.nspans; ++i) {
        WireSpan w;
        std::memcpy(&w, static_cast<const std::byte*>(data) + i * sizeof w, sizeof w);
        rows[i] = {w.local_offset, w.remote_offset, w.length};
      }
      core_.progress().defer([this, to, h, r = std::move(rows), p = std::move(pages)]() mutable {
        core_.serving().serve_read(to, h, std::move(r), {}, std::move(p));
      });
      return UCS_OK;
    }
    case kAmDone: {
      if (header_length != sizeof(DoneHdr) || rndv) return UCS_OK;
      DoneHdr h;
      std::memcpy(&h, header, sizeof h);
      // A notice for another registration of this cache is stale: ignore it.
      if (h.generation != core_.worker().region().generation || h.epoch == 0 ||
          !ticket_valid(h.ticket)) {
        return UCS_OK;
      }
      core_.progress().defer([this, h] {
        std::function<void(std::uint64_t, std::uint64_t)> handler;
        {
          std::lock_guard<std::mutex> lk(done_mu_);
          handler = done_handler_;
        }
        if (handler) handler(h.seq_id, h.epoch);
      });
      return UCS_OK;
    }
    case kAmReadyReq: {
      if (header_length != sizeof(ReadyReqHdr) || !has_reply_ep || rndv) return UCS_OK;
      ReadyReqHdr h;
      std::memcpy(&h, header, sizeof h);
      Served to = served_of(param->reply_ep);
      if (!to) return UCS_OK;
      // Untrusted: the page count must match the length exactly.
      if (h.npages == 0 || h.npages > kMaxReadyPages || h.epoch == 0 ||
          length != h.npages * sizeof(std::uint32_t)) {
        core_.progress().defer([this, to, h] {
          const std::string why = "malformed readiness request";
          const ReadyHdr out{h.watch_id, 0,
                             static_cast<std::uint32_t>(StatusCode::kInvalidArgument)};
          reply(to, kAmReadyNotice, &out, sizeof out, why.data(), why.size());
        });
        return UCS_OK;
      }
      std::vector<std::uint32_t> pages(h.npages);
      std::memcpy(pages.data(), data, length);
      core_.progress().defer(
          [this, to, h, p = std::move(pages)]() mutable { on_ready_req(to, h, std::move(p)); });
      return UCS_OK;
    }
    case kAmBind: {
      if (header_length != sizeof(BindHdr) || !has_reply_ep || rndv) return UCS_OK;
      BindHdr h;
      std::memcpy(&h, header, sizeof h);
      // Bound in this handler, while reply_ep is certainly valid, so that
      // no request of the connection can overtake it.
      on_bind(param->reply_ep, h);
      return UCS_OK;
    }
    case kAmPing: {  // answered after this round, whatever the owner is busy with
      if (header_length != sizeof(PingHdr) || !has_reply_ep || rndv) return UCS_OK;
      PingHdr h;
      std::memcpy(&h, header, sizeof h);
      Served to = served_of(param->reply_ep);
      if (to) {
        core_.progress().defer([this, to, h] { reply(to, kAmPong, &h, sizeof h, nullptr, 0); });
      }
      return UCS_OK;
    }
    default:
      return UCS_OK;
  }
}

ucs_status_t UcxReader::handle_am(unsigned id, const void* header, std::size_t header_length,
                                  void* data, std::size_t length,
                                  const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  switch (id) {
    case kAmChallenge: {
      if (header_length != sizeof(ChallengeHdr) || rndv) return UCS_OK;
      ChallengeHdr h;
      std::memcpy(&h, header, sizeof h);
      core_.progress().defer([this, h] { on_challenge(h); });
      return UCS_OK;
    }
    case kAmHelloReply: {
      if (header_length != sizeof(HelloHdr) || rndv) return UCS_OK;
      HelloHdr h;
      std::memcpy(&h, header, sizeof h);
      std::vector<std::uint8_t> bytes(static_cast<std::uint8_t*>(data),
                                      static_cast<std::uint8_t*>(data) + length);
      core_.progress().defer([this, h, b = std::move(bytes)] { hello_reply(h, b); });
      return UCS_OK;
    }
    case kAmReadyNotice: {
      if (header_length != sizeof(ReadyHdr) || rndv) return UCS_OK;
      ReadyHdr h;
      std::memcpy(&h, header, sizeof h);
      std::string msg(static_cast<const char*>(data), std::min<std::size_t>(length, 1024));
      core_.progress().defer(
          [this, h, m = std::move(msg)]() mutable { on_ready_notice(h, std::move(m)); });
      return UCS_OK;
    }
    case kAmBound: {
      if (header_length != sizeof(BindHdr) || rndv) return UCS_OK;
      BindHdr h;
      std::memcpy(&h, header, sizeof h);
      core_.progress().defer([this, h] { on_bound(h); });
      return UCS_OK;
    }
    case kAmPong: {  // the owner is alive (check_peers)
      if (header_length != sizeof(PingHdr) || rndv) return UCS_OK;
      PingHdr h;
      std::memcpy(&h, header, sizeof h);
      auto it = conns_.find(h.conn_id);
      if (it != conns_.end()) it->second->heard = std::chrono::steady_clock::now();
      return UCS_OK;
    }
    default:
      return UCS_OK;
  }
}

ucs_status_t UcxReads::handle_am(unsigned id, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  switch (id) {
    case kAmReadData: {
      if (header_length != sizeof(DataHdr)) return UCS_OK;
      DataHdr h;
      std::memcpy(&h, header, sizeof h);
      return handle_data(h, data, length, param);
    }
    case kAmGatherData: {
      if (header_length != sizeof(GatherHdr)) return UCS_OK;
      GatherHdr h;
      std::memcpy(&h, header, sizeof h);
      return handle_gather(h, data, length, rndv);
    }
    case kAmReadErr: {
      if (header_length != sizeof(ErrHdr) || rndv) return UCS_OK;
      ErrHdr h;
      std::memcpy(&h, header, sizeof h);
      auto it = batches_.find(h.batch_id);
      if (it == batches_.end()) return UCS_OK;
      StatusCode code = static_cast<StatusCode>(h.code);
      if (h.code > static_cast<std::uint32_t>(kLastStatusCode) || h.code == 0) {
        code = StatusCode::kInternal;
      }
      std::string msg(static_cast<const char*>(data), std::min<std::size_t>(length, 1024));
      fail_batch(it->second, Status(code, "owner rejected the read: " + msg));
      return UCS_OK;
    }
    case kAmReadFin: {
      if (header_length != sizeof(ErrHdr) || rndv) return UCS_OK;
      ErrHdr h;
      std::memcpy(&h, header, sizeof h);
      auto it = batches_.find(h.batch_id);
      if (it == batches_.end()) return UCS_OK;
      it->second->conn->heard = std::chrono::steady_clock::now();
      // Only kOk or kStaleDescriptor are answers; anything else is a broken owner.
      Status st;
      if (h.code == static_cast<std::uint32_t>(StatusCode::kStaleDescriptor)) {
        st = Status(StatusCode::kStaleDescriptor, std::string(static_cast<const char*>(data),
                                                              std::min<std::size_t>(length, 1024)));
      } else if (h.code != 0) {
        st = Status(StatusCode::kInternal,
                    "owner answered an epoch check with code " + std::to_string(h.code));
      }
      on_fin(it->second, st);
      return UCS_OK;
    }
    default:
      return UCS_OK;
  }
}

ucs_status_t UcxReads::handle_data(const DataHdr& h, void* data, std::size_t length,
                                   const ucp_am_recv_param_t* param) {
  auto it = batches_.find(h.batch_id);
  // A stopped or unknown read: drop the data (a rendezvous is dropped too,
  // and the owner's send completes).
  if (it == batches_.end()) return UCS_OK;
  auto b = it->second;
  b->conn->heard = std::chrono::steady_clock::now();
  if (b->aborted || b->failure) return UCS_OK;
  auto p = b->pending.find(h.local_offset);
  if (p == b->pending.end() || p->second != h.length || h.length != length) {
    // The owner sent something this read did not ask for: never write it.
    fail_batch(b, Status(StatusCode::kInternal,
                         "owner sent " + std::to_string(length) + " bytes for local offset " +
                             std::to_string(h.local_offset) + " that the read did not ask for"));
    return UCS_OK;
  }
  b->pending.erase(p);
  core_.trace("read %llu: reply %zu B%s, %zu to come", static_cast<unsigned long long>(b->id),
              length, (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? " (rndv)" : "",
              b->pending.size());
  std::byte* dest = cache_->at(h.local_offset);  // a span is in one region
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    std::memcpy(dest, data, length);
    maybe_finish(b);
    return UCS_OK;
  }
  auto* ctx = new_ctx(b->id);
  ctx->memh = core_.worker().memh_at(h.local_offset);
  return post_recv(b, data, dest, length, ctx);
}

ucs_status_t UcxReads::post_recv(const std::shared_ptr<Batch>& b, void* data, void* buffer,
                                 std::size_t count, ReqCtx* ctx) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = trampoline<&UcxReads::on_recv_done, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  if (!ctx->gathered) {  // contiguous, in our registered pages
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = ctx->memh;
  } else {  // the rows of a gathered reply
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    rp.datatype = core_.worker().sink_dt();
  }
  ucs_status_ptr_t sp = ucp_am_recv_data_nbx(core_.worker().get(), data, buffer, count, &rp);
  if (UCS_PTR_IS_PTR(sp)) {
    ++b->outstanding;
    return UCS_INPROGRESS;
  }
  core_.worker().read_requests().take(ctx);
  if (UCS_PTR_IS_ERR(sp)) {
    fail_batch(b, Status(StatusCode::kPeerFailure,
                         "ucp_am_recv_data_nbx: " + ucs_str(UCS_PTR_STATUS(sp))));
  } else {
    maybe_finish(b);
  }
  return UCS_INPROGRESS;
}

ucs_status_t UcxReads::handle_gather(const GatherHdr& h, void* data, std::size_t length,
                                     bool rndv) {
  auto it = batches_.find(h.batch_id);
  if (it == batches_.end()) return UCS_OK;  // a stopped or unknown read: dropped
  auto b = it->second;
  b->conn->heard = std::chrono::steady_clock::now();
  if (b->aborted || b->failure) return UCS_OK;
  // Untrusted: a group of this read's units (spans, or whole strided
  // spans), each once, with their bytes.
  const std::size_t units = b->units();
  const bool strided = !b->strided.empty();
  bool ok = b->gather && h.count > 0 && h.first < units && h.count <= units - h.first &&
            h.length == length && data != nullptr;
  std::uint64_t bytes = 0;
  for (std::size_t k = 0; ok && k < h.count; ++k) {
    ok = b->got[h.first + k] == 0;
    bytes += strided ? b->strided[h.first + k].bytes() : b->chunks[h.first + k].length;
  }
  if (!ok || bytes != length) {
    fail_batch(b, Status(StatusCode::kInternal,
                         "owner sent a gathered reply (spans " + std::to_string(h.first) + "+" +
                             std::to_string(h.count) + ", " + std::to_string(length) +
                             " bytes) that the read did not ask for"));
    return UCS_OK;
  }
  std::fill_n(b->got.begin() + static_cast<std::ptrdiff_t>(h.first), h.count, std::uint8_t{1});
  b->got_count += h.count;
  core_.trace("read %llu: gathered reply %zu B%s, %zu of %zu units",
              static_cast<unsigned long long>(b->id), length, rndv ? " (rndv)" : "", b->got_count,
              units);
  if (b->staged) return core_.staging().staged_arrival(b, h, data, length, rndv);
  const RegionMap& base = cache_->regions();
  if (rndv) {  // UCX hands the fragments to the local rows (a RowSink)
    // The group's spans are copied into the request: UCX may call the sink
    // until the request completes, whatever happens to the read meanwhile.
    auto* ctx = new_ctx(b->id);
    ctx->spans.reserve(h.count);
    for (std::size_t k = 0; k < h.count; ++k) {
      if (strided) {
        ctx->spans.push_back(b->strided[h.first + k]);
      } else {
        const rma::RmaRead& r = b->chunks[h.first + k];
        ctx->spans.push_back({r.local_offset, r.remote_offset, r.length, 1, 0, 0});
      }
    }
    ctx->gathered = true;
    ctx->sink = RowSink(base, ctx->spans.data(), h.count, length, b->stream);
    return post_recv(b, data, &ctx->sink, 1, ctx);
  }
  const auto* src = static_cast<const std::byte*>(data);
  for (std::size_t k = 0; k < h.count; ++k) {
    if (strided) {
      const StridedSpan& s = b->strided[h.first + k];
      for (std::uint64_t r = 0; r < s.rows; ++r, src += s.length) {
        std::memcpy(base.pointer(s.local_offset) + r * s.local_stride, src, s.length);
      }
    } else {
      const rma::RmaRead& r = b->chunks[h.first + k];
      std::memcpy(base.pointer(r.local_offset), src, r.length);
      src += r.length;
    }
  }
  maybe_finish(b);
  return UCS_OK;
}

}  // namespace mstar::kv::ucx
