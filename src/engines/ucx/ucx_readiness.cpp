// Copyright mstar-kv authors.
//
// Layer readiness (layer-wise streaming, readiness.hpp) over the
// engine's own channel: the reader keeps one kAmReadyReq outstanding per
// watch; the owner checks the epochs and readiness words of its own cache
// (check_layer_readiness, the same checks a shm reader makes on the mapped
// words) and answers with a kAmReadyNotice as soon as the count moves past
// the reader's floor, when a check fails, or after kReadyHoldMs. The owner's
// KVCachePool::mark_layers_ready stays a few stores (no message, no
// syscall): the owner's progress thread notices the words change.
#include "ucx_core.hpp"

#include "mstar/kv/core/readiness.hpp"

namespace mstar::kv::ucx {

namespace {

// The most requests one owner holds at a time; beyond it a request is
// answered at once with the unchanged count (the reader asks again, i.e. it
// degrades to polling instead of growing without bound).
constexpr std::size_t kMaxReadyHolds = 4096;

class UcxLayerWatch final : public LayerWatch {
 public:
  UcxLayerWatch(std::shared_ptr<UcxCore> core, std::shared_ptr<ReadyWatch> w)
      : core_(std::move(core)), w_(std::move(w)) {}
  ~UcxLayerWatch() override {
    UcxCore* c = core_.get();
    const std::uint64_t id = w_->id;
    try {
      (void)c->post([c, id] { c->reader().forget_watch(id); });
    } catch (...) {
      // Out of memory: the entry goes with the notice that answers it.
    }
  }

  Status poll(std::uint32_t* layers_ready) override {
    internal::UniqueLock lk(w_->mu);
    if (w_->error) return *w_->error;
    if (w_->conn->failed.load(std::memory_order_acquire)) {
      return {StatusCode::kPeerFailure,
              "the owner at " + w_->conn->session_id + " is unreachable (connection lost) with " +
                  std::to_string(w_->layers) + " of " + std::to_string(w_->num_layers) +
                  " layers marked ready"};
    }
    *layers_ready = w_->layers;
    if (!w_->outstanding && w_->layers < w_->num_layers) {
      w_->outstanding = true;
      lk.unlock();
      UcxCore* c = core_.get();
      if (!c->post([c, w = w_] { c->reader().send_ready_req(w); })) {
        return {StatusCode::kShutdown, "the ucx engine is shut down"};
      }
    }
    return Status::ok();
  }

 private:
  std::shared_ptr<UcxCore> core_;
  std::shared_ptr<ReadyWatch> w_;
};

}  // namespace

std::unique_ptr<LayerWatch> make_ready_watch(std::shared_ptr<UcxCore> core,
                                             std::shared_ptr<Conn> conn,
                                             std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                             std::uint32_t num_layers) {
  if (pages.empty() || pages.size() > kMaxReadyPages) {
    throw Error(StatusCode::kInvalidArgument, "ucx layer watch of " + std::to_string(pages.size()) +
                                                  " pages: must be in [1, " +
                                                  std::to_string(kMaxReadyPages) + "]");
  }
  auto w = std::make_shared<ReadyWatch>();
  w->id = core->reader().next_watch.fetch_add(1, std::memory_order_relaxed);
  w->conn = std::move(conn);
  w->pages = std::move(pages);
  w->epoch = epoch;
  w->num_layers = num_layers;
  return std::make_unique<UcxLayerWatch>(std::move(core), std::move(w));
}

// ---- reader ----------------------------------------------------------------

void UcxReader::send_ready_req(const std::shared_ptr<ReadyWatch>& w) {
  const auto& c = w->conn;
  if (c->closing || !c->ep) {
    std::lock_guard<std::mutex> lk(w->mu);
    w->outstanding = false;
    if (!w->error) {
      w->error = Status(StatusCode::kPeerFailure,
                        "the connection to the owner at " + c->session_id + " is closed");
    }
    return;
  }
  ReadyReqHdr hdr{};
  hdr.watch_id = w->id;
  hdr.generation = c->served.generation;
  hdr.epoch = w->epoch;
  {
    std::lock_guard<std::mutex> lk(w->mu);
    hdr.floor = w->layers;
  }
  hdr.npages = w->pages.size();
  hdr.ticket = c->ticket;
  watches_[w->id] = w;
  core_.worker().send_small(c->ep.get(), kAmReadyReq, &hdr, sizeof hdr, w->pages.data(),
                            w->pages.size() * sizeof(std::uint32_t), true, c->id);
}

void UcxReader::on_ready_notice(const ReadyHdr& h, std::string message) {
  auto it = watches_.find(h.watch_id);
  if (it == watches_.end()) return;  // forgotten, or never ours
  const std::shared_ptr<ReadyWatch> w = std::move(it->second);
  watches_.erase(it);
  std::lock_guard<std::mutex> lk(w->mu);
  w->outstanding = false;
  if (w->error) return;
  if (h.code != 0) {
    // Untrusted: a code we do not know is a broken owner.
    StatusCode code = static_cast<StatusCode>(h.code);
    if (h.code > static_cast<std::uint32_t>(kLastStatusCode)) code = StatusCode::kInternal;
    w->error = Status(code, "the owner at " + w->conn->session_id + ": " + message);
    return;
  }
  if (h.layers > w->num_layers) {
    w->error = Status(StatusCode::kCorruptDescriptor,
                      "the owner at " + w->conn->session_id + " says " + std::to_string(h.layers) +
                          " layers are ready, beyond the layout's " +
                          std::to_string(w->num_layers) + " layers");
  } else if (h.layers < w->layers) {
    w->error = Status(StatusCode::kCorruptDescriptor,
                      "the owner at " + w->conn->session_id +
                          ": readiness went backwards: " + std::to_string(h.layers) +
                          " layers ready, " + std::to_string(w->layers) + " were ready before");
  } else {
    w->layers = h.layers;
  }
}

// ---- owner -----------------------------------------------------------------

void UcxOwner::on_ready_req(const Served& to, const ReadyReqHdr& h,
                            std::vector<std::uint32_t> pages) {
  if (to->conn || !to->open) return;  // held only for live listener endpoints
  ReadyHold r{to, h, std::move(pages),
              std::chrono::steady_clock::now() + std::chrono::milliseconds(kReadyHoldMs)};
  if (answer_ready(r, ready_holds_.size() >= kMaxReadyHolds)) return;
  ready_holds_.push_back(std::move(r));
}

bool UcxOwner::answer_ready(const ReadyHold& r, bool expired) {
  const std::uint32_t num_layers = cache_->layout().num_layers;
  std::uint32_t layers = 0;
  Status st;
  if (r.hdr.generation != core_.worker().region().generation) {
    st = Status(StatusCode::kStaleDescriptor,
                "readiness asked of generation " + std::to_string(r.hdr.generation) +
                    ", this owner serves generation " +
                    std::to_string(core_.worker().region().generation));
  } else if (!ticket_valid(r.hdr.ticket)) {
    st = Status(StatusCode::kPermissionDenied,
                "readiness request without the ticket of an authenticated connection");
  } else if (r.hdr.floor > num_layers) {
    st = Status(StatusCode::kInvalidArgument,
                "readiness request with floor " + std::to_string(r.hdr.floor) +
                    " beyond the layout's " + std::to_string(num_layers) + " layers");
  } else {
    const PageEpochs& ep = cache_->epochs();
    st = check_layer_readiness(cache_->readiness().words(), ep.words(), ep.num_pages(), r.pages,
                               r.hdr.epoch, num_layers, static_cast<std::uint32_t>(r.hdr.floor),
                               &layers);
  }
  if (st.is_ok() && !expired && layers <= r.hdr.floor && layers < num_layers) return false;
  const ReadyHdr out{r.hdr.watch_id, st.is_ok() ? layers : 0,
                     static_cast<std::uint32_t>(st.code())};
  reply(r.ep, kAmReadyNotice, &out, sizeof out, st.message().data(), st.message().size());
  return true;
}

void UcxOwner::check_ready_holds() {
  const auto now = std::chrono::steady_clock::now();
  std::size_t kept = 0;
  for (std::size_t i = 0; i < ready_holds_.size(); ++i) {
    ReadyHold& r = ready_holds_[i];
    // A reader whose endpoint closed is gone: nobody to answer.
    if (!r.ep->usable() || answer_ready(r, now >= r.until)) continue;
    if (kept != i) ready_holds_[kept] = std::move(r);
    ++kept;
  }
  ready_holds_.resize(kept);
}

}  // namespace mstar::kv::ucx
