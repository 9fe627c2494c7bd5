// Copyright mstar-kv authors.
//
// UcxServedReads, the owner's side of a read (ucx_serve.hpp): checking its spans (or strided
// spans) against the region and its pages' epochs, grouping them into
// messages, sending them through a window of kSendWindow replies, and the
// epoch verdict once the last send completed.
#include "ucx_serve.hpp"

#include "ucx_core.hpp"

namespace mstar::kv::ucx {

UcxServedReads::UcxServedReads(UcxCore& core) : UcxPart(core, core.cache(), core.options()) {}

bool UcxServedReads::within_one_layer(std::uint64_t first, std::uint64_t last) const noexcept {
  const std::uint64_t layer_bytes = core_.worker().layer_bytes();
  return layer_bytes == 0 || first / layer_bytes == last / layer_bytes;
}

Status UcxServedReads::check_served_epochs(std::uint64_t epoch,
                                           const std::vector<std::uint32_t>& pages,
                                           const char* when) const {
  const PageEpochs& ep = cache_->epochs();
  return check_page_epochs(ep.words(), ep.num_pages(), pages, epoch, when,
                           /*after_copy=*/true);
}

Status UcxServedReads::crosses_layers(const char* what, std::size_t i, std::uint64_t first,
                                      std::uint64_t last) const {
  return {StatusCode::kInvalidArgument,
          std::string(what) + " " + std::to_string(i) + " [" + std::to_string(first) + ", " +
              std::to_string(last + 1) + ") crosses a layer boundary of this owner's cache of " +
              "one region per layer (" + std::to_string(core_.worker().layer_bytes()) +
              " bytes a layer)"};
}

void UcxServedReads::serve_strided(const Served& to, const ReadReqHdr& h,
                                   const std::vector<WireStrided>& spans,
                                   std::vector<std::uint32_t> pages) {
  if (!to->usable()) {
    core_.owner().drop(1, "a read request");
    return;
  }
  // Untrusted: every row of every span inside the region, and no more rows
  // in all than a request of single spans may name, before any expansion.
  std::vector<StridedSpan> planned;
  planned.reserve(spans.size());
  std::uint64_t rows = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const WireStrided& s = spans[i];
    const std::uint64_t size = core_.worker().region().size;
    // The last row starts at remote_offset + (rows - 1) * remote_stride.
    const bool shape_ok = s.length != 0 && s.rows != 0 && s.rows <= kMaxSpansPerRequest &&
                          rows + s.rows <= kMaxSpansPerRequest;
    const bool inside =
        shape_ok && s.remote_offset <= size && s.length <= size - s.remote_offset &&
        (s.rows == 1 || (s.remote_stride <= (size - s.remote_offset - s.length) / (s.rows - 1)));
    if (!inside) {
      core_.owner().send_err(
          to, h.batch_id,
          Status(shape_ok ? StatusCode::kPermissionDenied : StatusCode::kInvalidArgument,
                 "strided span " + std::to_string(i) + " (" + std::to_string(s.rows) + " rows of " +
                     std::to_string(s.length) + " bytes from " + std::to_string(s.remote_offset) +
                     ", stride " + std::to_string(s.remote_stride) +
                     (shape_ok ? ") is outside the registered region of " + std::to_string(size) +
                                     " bytes"
                               : ") names no bytes or more than " +
                                     std::to_string(kMaxSpansPerRequest) + " rows in all")));
      return;
    }
    // A cache of one region per layer: every row inside one layer (the
    // rows ascend: the first's start and the last's end tell).
    const std::uint64_t last = s.remote_offset + (s.rows - 1) * s.remote_stride + s.length - 1;
    if (!within_one_layer(s.remote_offset, last)) {
      core_.owner().send_err(to, h.batch_id,
                             crosses_layers("strided span", i, s.remote_offset, last));
      return;
    }
    rows += s.rows;
    planned.push_back(
        {s.local_offset, s.remote_offset, s.length, s.rows, s.local_stride, s.remote_stride});
  }
  // Every row is inside the region now: serve_read need not look again.
  serve_read(to, h, {}, std::move(planned), std::move(pages));
}

void UcxServedReads::serve_read(const Served& to, const ReadReqHdr& h, std::vector<CopySpan> spans,
                                std::vector<StridedSpan> strided,
                                std::vector<std::uint32_t> pages) {
  const std::uint64_t batch_id = h.batch_id;
  const std::uint64_t flags = h.flags;
  core_.trace("serve %llu: %zu spans, %zu strided asked", static_cast<unsigned long long>(batch_id),
              spans.size(), strided.size());
  // The reader's connection closed since the request arrived: nobody to
  // answer.
  if (!to->usable()) {
    core_.owner().drop(1, "a read request");
    return;
  }
  // Validate the whole request before sending a byte: the reader is not
  // trusted with anything outside the registered region.
  const rma::RmaRegionInfo& region = core_.worker().region();
  if (h.generation != region.generation) {
    core_.owner().send_err(
        to, batch_id,
        Status(StatusCode::kStaleDescriptor,
               "read names generation " + std::to_string(h.generation) +
                   ", this owner serves generation " + std::to_string(region.generation)));
    return;
  }
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const CopySpan& s = spans[i];
    if (s.length == 0 || s.remote_offset > region.size ||
        s.length > region.size - s.remote_offset) {
      core_.owner().send_err(
          to, batch_id,
          Status(StatusCode::kPermissionDenied,
                 "span " + std::to_string(i) + " [" + std::to_string(s.remote_offset) + ", +" +
                     std::to_string(s.length) + ") is outside the registered region of " +
                     std::to_string(region.size) + " bytes"));
      return;
    }
    if (!within_one_layer(s.remote_offset, s.remote_offset + s.length - 1)) {
      core_.owner().send_err(
          to, batch_id, crosses_layers("span", i, s.remote_offset, s.remote_offset + s.length - 1));
      return;
    }
  }
  // Owner-served: the pages must still belong to the reader's sequence
  // before the first byte goes out (and after the last, in serve_done).
  if (h.epoch != 0) {
    if (Status st = check_served_epochs(h.epoch, pages, "before the owner sent it"); !st.is_ok()) {
      core_.owner().send_err(to, batch_id, st);
      return;
    }
  }
  auto q = std::make_shared<SendQueue>();
  q->ep = to;
  q->batch_id = batch_id;
  q->flags = flags;
  q->epoch = h.epoch;
  if (h.epoch != 0) q->pages = std::move(pages);
  q->spans = std::move(spans);
  q->strided = std::move(strided);
  if (!q->strided.empty()) {
    q->groups = gather_groups(
        q->strided.size(), [&](std::size_t i) { return q->strided[i].bytes(); },
        [&](std::size_t i) { return q->strided[i].rows; });
  } else if ((flags & kReqGather) != 0) {
    q->groups = gather_groups(
        q->spans.size(), [&](std::size_t i) { return q->spans[i].length; },
        [](std::size_t) { return std::uint64_t{1}; });
  }
  if (core_.staging().active() && !core_.staging().stage_sends(q)) return;
  q->left = q->total() + 1;
  pump(q);
}

void UcxServedReads::pump(const std::shared_ptr<SendQueue>& q) {
  if (q->done_posting) return;
  // The reader's connection closed (it fails by itself) or we stop: the
  // rest of the read is never sent.
  const bool gone = !q->ep->usable();
  if (gone || q->failed || core_.progress().stopping()) {
    // What was never posted, and the verdict, for a reader that is gone.
    const std::size_t unsent = q->total() - q->next + (q->epoch != 0 ? 1 : 0);
    if (gone && unsent != 0) core_.owner().drop(unsent, "a data reply");
    q->failed = true;
    if (q->staged) q->staged->abort();  // no gather starts; those running finish
  } else {
    // At most a window per call: sends that complete at once (small eager
    // ones) do not stay in flight, and the rest of the read then follows
    // after this round's other work.
    std::size_t posted_now = 0;
    while (q->in_flight < kSendWindow && posted_now < kSendWindow && q->next < q->total()) {
      std::optional<staging::GatherPipeline::Ready> gathered;
      if (q->staged && !(gathered = q->staged->poll())) break;  // none gathered yet
      const std::size_t k = q->next++;
      ++posted_now;
      const bool ok = gathered ? core_.staging().send_staged(q, *gathered)
                      : q->groups.empty()
                          ? send_span(q, q->spans[k])
                          : send_gathered(q, q->groups[k].first, q->groups[k].second);
      if (!ok) {  // the endpoint failed; its error handler closes it
        q->failed = true;
        break;
      }
    }
    if (q->staged && !q->failed && !q->staged->status().is_ok()) {
      // A gather failed (the device copy): the reader learns why now.
      core_.owner().send_err(q->ep, q->batch_id, q->staged->status());
      q->failed = true;
    }
    if (!q->failed && q->next < q->total()) {
      if (q->in_flight != 0) return;  // each completion pumps
      // Staged: a gather runs; the progress loop pumps again (poll_staged).
      if (q->staged) {
        core_.staging().wait_gather(q);
      } else {
        core_.progress().later([this, q] { pump(q); });
      }
      return;
    }
  }
  q->done_posting = true;
  if (--q->left == 0) core_.progress().later([this, q] { serve_done(q); });
}

bool UcxServedReads::send_span(const std::shared_ptr<SendQueue>& q, const CopySpan& s) {
  auto owned = std::make_unique<SendCtx>();
  owned->core = &core_;
  owned->hdr = DataHdr{q->batch_id, s.local_offset, s.length};
  owned->bytes = s.length;
  owned->queue = q;
  SendCtx* ctx = core_.worker().send_requests().add(std::move(owned));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
  rp.flags = (q->flags & kReqEagerOnly) == 0 && s.length >= options_.rndv_bytes
                 ? UCP_AM_SEND_FLAG_RNDV
                 : UCP_AM_SEND_FLAG_EAGER;
  rp.memh = core_.worker().memh_at(s.remote_offset);
  rp.cb.send = trampoline<&UcxServedReads::on_data_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  ucs_status_ptr_t sp = ucp_am_send_nbx(q->ep->ep, kAmReadData, &ctx->hdr, sizeof ctx->hdr,
                                        cache_->at(s.remote_offset), s.length, &rp);
  return posted(q, ctx, sp);
}

// Completion of a data reply (one span's, or a gathered group's): the
// read's next replies go out, and its epoch verdict once its last send
// completed. UCX may complete a send as successful after the endpoint was
// closed (forced: destroyed at once): what runs next looks at the record.
void UcxServedReads::on_data_sent(void* req, ucs_status_t st, void* ud) {
  const Request freed(req);
  auto* raw = context_of<SendCtx>(ud);
  UcxCore* core = raw->core;
  const std::unique_ptr<SendCtx> c = core->worker().send_requests().take(raw);
  if (!c) return;
  const std::shared_ptr<SendQueue>& q = c->queue;
  --q->in_flight;
  core->trace("serve %llu: sent %llu B (%s), %zu in flight, %zu of %zu posted",
              static_cast<unsigned long long>(q->batch_id),
              static_cast<unsigned long long>(c->bytes), ucs_status_string(st), q->in_flight,
              q->next, q->total());
  if (c->staged) q->staged->sent(*c->staged);  // its buffer gathers the next message
  if (st == UCS_OK) {
    core->owner().counters().bytes.fetch_add(c->bytes, std::memory_order_relaxed);
    if (c->staged) core->owner().counters().staged.fetch_add(c->bytes, std::memory_order_relaxed);
  } else {
    q->failed = true;
  }
  UcxServedReads& self = core->serving();
  if (!q->done_posting) core->progress().later([&self, q] { self.pump(q); });
  if (--q->left == 0) core->progress().later([&self, q] { self.serve_done(q); });
}

bool UcxServedReads::send_gathered(const std::shared_ptr<SendQueue>& q, std::size_t first,
                                   std::size_t count) {
  auto owned = std::make_unique<SendCtx>();
  owned->core = &core_;
  owned->queue = q;
  SendCtx* ctx = owned.get();
  std::uint64_t bytes = 0;
  const bool strided = !q->strided.empty();
  if (!strided) {
    owned->iov.resize(count);
    for (std::size_t k = 0; k < count; ++k) {
      const CopySpan& s = q->spans[first + k];
      ctx->iov[k].buffer = cache_->at(s.remote_offset);
      ctx->iov[k].length = s.length;
      bytes += s.length;
    }
  } else {  // the spans' rows, packed by UCX straight from the pages
    for (std::size_t k = 0; k < count; ++k) bytes += q->strided[first + k].bytes();
    ctx->rows = RowSource{cache_->regions(), q->strided.data() + first, count, bytes};
  }
  ctx->gather = GatherHdr{q->batch_id, first, count, bytes};
  ctx->bytes = bytes;
  core_.worker().send_requests().add(std::move(owned));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  // Rendezvous for big groups (UCX moves the rows from our pages into the
  // reader's, an iov on both sides), eager otherwise (the reader scatters
  // from its receive buffer); eager only for readers that ask for it.
  rp.flags = (q->flags & kReqEagerOnly) == 0 && bytes >= options_.rndv_bytes
                 ? UCP_AM_SEND_FLAG_RNDV
                 : UCP_AM_SEND_FLAG_EAGER;
  rp.datatype = strided ? core_.worker().rows_dt() : ucp_dt_make_iov();
  rp.cb.send = trampoline<&UcxServedReads::on_data_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(ctx);
  ucs_status_ptr_t sp =
      strided ? ucp_am_send_nbx(q->ep->ep, kAmGatherData, &ctx->gather, sizeof ctx->gather,
                                &ctx->rows, 1, &rp)
              : ucp_am_send_nbx(q->ep->ep, kAmGatherData, &ctx->gather, sizeof ctx->gather,
                                ctx->iov.data(), ctx->iov.size(), &rp);
  return posted(q, ctx, sp);
}

// After ucp_am_send_nbx of ctx: in flight (the callback completes it), or
// done or failed at once. False when the endpoint failed.
bool UcxServedReads::posted(const std::shared_ptr<SendQueue>& q, SendCtx* ctx,
                            ucs_status_ptr_t sp) {
  if (UCS_PTR_IS_PTR(sp)) {
    ++q->in_flight;
    return true;
  }
  const std::unique_ptr<SendCtx> done = core_.worker().send_requests().take(ctx);
  --q->left;  // never 0 here: pump holds one while posting
  if (done->staged) q->staged->sent(*done->staged);
  if (UCS_PTR_IS_ERR(sp)) return false;
  core_.owner().counters().bytes.fetch_add(done->bytes, std::memory_order_relaxed);
  if (done->staged)
    core_.owner().counters().staged.fetch_add(done->bytes, std::memory_order_relaxed);
  return true;
}

void UcxServedReads::serve_done(const std::shared_ptr<SendQueue>& q) {
  core_.trace("serve %llu: every send completed%s", static_cast<unsigned long long>(q->batch_id),
              q->failed ? " (failed)" : "");
  if (q->failed) return;  // a send failed: the reader fails by itself
  if (q->epoch != 0) {
    if (!q->ep->usable()) {
      core_.owner().drop(1, "an epoch verdict");
      return;
    }
    Status s = check_served_epochs(q->epoch, q->pages, "while the owner sent it");
    const ErrHdr hdr{q->batch_id, static_cast<std::uint32_t>(s.code()), 0};
    core_.worker().send_small(q->ep->ep, kAmReadFin, &hdr, sizeof hdr, s.message().data(),
                              s.message().size(), false);
  }
  core_.owner().counters().reads.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace mstar::kv::ucx
