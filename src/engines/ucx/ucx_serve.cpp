// Copyright mstar-kv authors.
//
// UcxCore, the owner's side of a read: checking its spans (or strided
// spans) against the region and its pages' epochs, grouping them into
// messages, sending them through a window of kSendWindow replies, and the
// epoch verdict once the last send completed.
#include "ucx_core.hpp"

namespace mstar::kv::ucx {

Status UcxCore::check_served_epochs(std::uint64_t epoch,
                                   const std::vector<std::uint32_t>& pages,
                                   const char* when) const {
  const PageEpochs& ep = cache_->epochs();
  return check_page_epochs(ep.words(), ep.num_pages(), pages, epoch, when,
                           /*after_copy=*/true);
}

void UcxCore::serve_strided(ucp_ep_h ep, const ReadReqHdr& h,
                            const std::vector<WireStrided>& spans,
                            std::vector<std::uint32_t> pages) {
  if (dead_eps_.count(ep) != 0) return;
  // Untrusted: every row of every span inside the region, and no more rows
  // in all than a request of single spans may name, before any expansion.
  std::vector<StridedSpan> planned;
  planned.reserve(spans.size());
  std::uint64_t rows = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const WireStrided& s = spans[i];
    const std::uint64_t size = region_.size;
    // The last row starts at remote_offset + (rows - 1) * remote_stride.
    const bool shape_ok = s.length != 0 && s.rows != 0 && s.rows <= kMaxSpansPerRequest &&
                          rows + s.rows <= kMaxSpansPerRequest;
    const bool inside =
        shape_ok && s.remote_offset <= size && s.length <= size - s.remote_offset &&
        (s.rows == 1 ||
         (s.remote_stride <= (size - s.remote_offset - s.length) / (s.rows - 1)));
    if (!inside) {
      send_err(ep, h.batch_id,
               Status(shape_ok ? StatusCode::kPermissionDenied : StatusCode::kInvalidArgument,
                      "strided span " + std::to_string(i) + " (" + std::to_string(s.rows) +
                          " rows of " + std::to_string(s.length) + " bytes from " +
                          std::to_string(s.remote_offset) + ", stride " +
                          std::to_string(s.remote_stride) +
                          (shape_ok ? ") is outside the registered region of " +
                                          std::to_string(size) + " bytes"
                                    : ") names no bytes or more than " +
                                          std::to_string(kMaxSpansPerRequest) +
                                          " rows in all")));
      return;
    }
    rows += s.rows;
    planned.push_back({s.local_offset, s.remote_offset, s.length, s.rows, s.local_stride,
                       s.remote_stride});
  }
  // Every row is inside the region now: serve_read need not look again.
  serve_read(ep, h, {}, std::move(planned), std::move(pages));
}

void UcxCore::serve_read(ucp_ep_h ep, const ReadReqHdr& h, std::vector<CopySpan> spans,
                         std::vector<StridedSpan> strided, std::vector<std::uint32_t> pages) {
  const std::uint64_t batch_id = h.batch_id;
  const std::uint64_t flags = h.flags;
  // The reply endpoint is one of our listener's endpoints or one UCX made
  // for a reader's data endpoint; only a listener endpoint closed since the
  // request arrived (same progress round) is gone.
  if (dead_eps_.count(ep) != 0) return;
  // Validate the whole request before sending a byte: the reader is not
  // trusted with anything outside the registered region.
  if (h.generation != region_.generation) {
    send_err(ep, batch_id,
             Status(StatusCode::kStaleDescriptor,
                    "read names generation " + std::to_string(h.generation) +
                        ", this owner serves generation " +
                        std::to_string(region_.generation)));
    return;
  }
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const CopySpan& s = spans[i];
    if (s.length == 0 || s.remote_offset > region_.size ||
        s.length > region_.size - s.remote_offset) {
      send_err(ep, batch_id,
               Status(StatusCode::kPermissionDenied,
                      "span " + std::to_string(i) + " [" + std::to_string(s.remote_offset) +
                          ", +" + std::to_string(s.length) +
                          ") is outside the registered region of " +
                          std::to_string(region_.size) + " bytes"));
      return;
    }
  }
  // Owner-served: the pages must still belong to the reader's sequence
  // before the first byte goes out (and after the last, in serve_done).
  std::shared_ptr<ServeState> serve;
  if (h.epoch != 0) {
    if (Status st = check_served_epochs(h.epoch, pages, "before the owner sent it");
        !st.is_ok()) {
      send_err(ep, batch_id, st);
      return;
    }
    serve = std::make_shared<ServeState>();
    serve->ep = ep;
    serve->batch_id = batch_id;
    serve->epoch = h.epoch;
    serve->pages = std::move(pages);
  }
  auto q = std::make_shared<SendQueue>();
  q->ep = ep;
  q->batch_id = batch_id;
  q->flags = flags;
  q->serve = serve;
  q->spans = std::move(spans);
  q->strided = std::move(strided);
  if (!q->strided.empty()) {
    // Groups of whole strided spans, each one message of at most
    // kGatherBytes and kGatherMaxSpans rows (or one span).
    for (std::size_t i = 0; i < q->strided.size();) {
      std::size_t j = i;
      std::uint64_t bytes = 0;
      std::uint64_t rows = 0;
      while (j < q->strided.size() &&
             (j == i || (bytes + q->strided[j].bytes() <= kGatherBytes &&
                         rows + q->strided[j].rows <= kGatherMaxSpans))) {
        bytes += q->strided[j].bytes();
        rows += q->strided[j].rows;
        ++j;
      }
      q->groups.emplace_back(i, j - i);
      i = j;
    }
  } else if ((flags & kReqGather) != 0) {
    // Groups of consecutive spans, each one message (kAmGatherData).
    for (std::size_t i = 0; i < q->spans.size();) {
      std::size_t j = i;
      std::uint64_t bytes = 0;
      while (j < q->spans.size() && j - i < kGatherMaxSpans &&
             (j == i || bytes + q->spans[j].length <= kGatherBytes)) {
        bytes += q->spans[j].length;
        ++j;
      }
      q->groups.emplace_back(i, j - i);
      i = j;
    }
  }
  if (serve) serve->left = q->total() + 1;
  pump(q);
}

void UcxCore::pump(const std::shared_ptr<SendQueue>& q) {
  if (q->done_posting) return;
  // The reader's endpoint went away (it fails by itself) or we stop: the
  // rest of the read is never sent.
  if (dead_eps_.count(q->ep) != 0 || stop_requested_.load(std::memory_order_acquire)) {
    q->done_posting = true;
    return;
  }
  while (q->in_flight < kSendWindow && q->next < q->total()) {
    const std::size_t k = q->next++;
    const bool ok = q->groups.empty() ? send_span(q, q->spans[k])
                                      : send_gathered(q, q->groups[k].first, q->groups[k].second);
    if (!ok) {  // the endpoint failed; its error handler closes it
      q->done_posting = true;
      return;
    }
  }
  if (q->next == q->total()) {
    q->done_posting = true;
    if (q->serve && --q->serve->left == 0) serve_done(q->serve);
  }
}

bool UcxCore::send_span(const std::shared_ptr<SendQueue>& q, const CopySpan& s) {
  auto owned = std::make_unique<SendCtx>();
  owned->core = this;
  owned->hdr = DataHdr{q->batch_id, s.local_offset, s.length};
  owned->serve = q->serve;
  owned->queue = q;
  SendCtx* ctx = sends_.add(std::move(owned));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  rp.flags = (q->flags & kReqEagerOnly) == 0 && s.length >= options_.rndv_bytes
                 ? UCP_AM_SEND_FLAG_RNDV
                 : UCP_AM_SEND_FLAG_EAGER;
  rp.memh = memh_.get();
  rp.cb.send = trampoline<&UcxCore::on_data_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  ucs_status_ptr_t sp = ucp_am_send_nbx(q->ep, kAmReadData, &ctx->hdr, sizeof ctx->hdr,
                                        cache_->base() + s.remote_offset, s.length, &rp);
  return posted(q, ctx, sp);
}

// Completion of a data reply (one span's, or a gathered group's): the
// read's next replies go out, and its epoch verdict once its last send
// completed.
void UcxCore::on_data_sent(void* req, ucs_status_t st, void* ud) {
  const Request freed(req);
  auto* raw = context_of<SendCtx>(ud);
  UcxCore* core = raw->core;
  const std::unique_ptr<SendCtx> c = core->sends_.take(raw);
  if (!c) return;
  if (c->queue) {
    --c->queue->in_flight;
    if (st != UCS_OK) c->queue->done_posting = true;
    if (!c->queue->done_posting) core->deferred_.push_back([core, q = c->queue] { core->pump(q); });
  }
  if (c->serve) {
    if (st != UCS_OK) c->serve->failed = true;
    if (--c->serve->left == 0) {
      core->deferred_.push_back([core, sv = c->serve] { core->serve_done(sv); });
    }
  }
}

bool UcxCore::send_gathered(const std::shared_ptr<SendQueue>& q, std::size_t first,
                            std::size_t count) {
  auto owned = std::make_unique<SendCtx>();
  owned->core = this;
  owned->serve = q->serve;
  owned->queue = q;
  SendCtx* ctx = owned.get();
  std::uint64_t bytes = 0;
  const bool strided = !q->strided.empty();
  if (!strided) {
    owned->iov.resize(count);
    for (std::size_t k = 0; k < count; ++k) {
      const CopySpan& s = q->spans[first + k];
      ctx->iov[k].buffer = cache_->base() + s.remote_offset;
      ctx->iov[k].length = s.length;
      bytes += s.length;
    }
  } else {  // the spans' rows, packed by UCX straight from the pages
    for (std::size_t k = 0; k < count; ++k) bytes += q->strided[first + k].bytes();
    ctx->rows = RowSource{cache_->base(), q->strided.data() + first, count, bytes};
  }
  ctx->gather = GatherHdr{q->batch_id, first, count, bytes};
  sends_.add(std::move(owned));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  // Rendezvous for big groups (UCX moves the rows from our pages into the
  // reader's, an iov on both sides), eager otherwise (the reader scatters
  // from its receive buffer); eager only for readers that ask for it.
  rp.flags = (q->flags & kReqEagerOnly) == 0 && bytes >= options_.rndv_bytes
                 ? UCP_AM_SEND_FLAG_RNDV
                 : UCP_AM_SEND_FLAG_EAGER;
  rp.datatype = strided ? rows_dt_.get() : ucp_dt_make_iov();
  rp.cb.send = trampoline<&UcxCore::on_data_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  ucs_status_ptr_t sp =
      strided ? ucp_am_send_nbx(q->ep, kAmGatherData, &ctx->gather, sizeof ctx->gather,
                                &ctx->rows, 1, &rp)
              : ucp_am_send_nbx(q->ep, kAmGatherData, &ctx->gather, sizeof ctx->gather,
                                ctx->iov.data(), ctx->iov.size(), &rp);
  return posted(q, ctx, sp);
}

// After ucp_am_send_nbx of ctx: in flight (the callback completes it), or
// done or failed at once. False when the endpoint failed.
bool UcxCore::posted(const std::shared_ptr<SendQueue>& q, SendCtx* ctx, ucs_status_ptr_t sp) {
  if (UCS_PTR_IS_PTR(sp)) {
    ++q->in_flight;
    return true;
  }
  sends_.take(ctx);
  if (q->serve) --q->serve->left;
  return !UCS_PTR_IS_ERR(sp);
}

void UcxCore::serve_done(const std::shared_ptr<ServeState>& st) {
  if (st->failed || dead_eps_.count(st->ep) != 0) return;  // the reader fails by itself
  Status s = check_served_epochs(st->epoch, st->pages, "while the owner sent it");
  const ErrHdr hdr{st->batch_id, static_cast<std::uint32_t>(s.code()), 0};
  send_small(st->ep, kAmReadFin, &hdr, sizeof hdr, s.message().data(), s.message().size(),
             false);
}

}  // namespace mstar::kv::ucx
