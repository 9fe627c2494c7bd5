// Copyright mstar-kv authors.
//
// The Mooncake backend's descriptor side: the backend_blob and identity page
// codecs, and connect(), which opens a peer's segment and checks the
// descriptor against the identity page the peer serves before any page read.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <vector>
#include <optional>
#include <utility>

#include "core/codec.hpp"
#include "mstar/kv/epochs.hpp"
#include "mooncake_backend.hpp"
#include "mooncake_readiness.hpp"
#include "mstar/kv/thread_annotations.hpp"

namespace mstar::kv::mooncake {

using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint16_t kBlobVersion = 3;  // 3: ready_ptr

void free_page(void* p) { std::free(p); }

}  // namespace

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

PagePtr alloc_page() {
  void* p = std::aligned_alloc(kIdentityBytes, kIdentityBytes);
  if (p == nullptr) throw Error(StatusCode::kInternal, "out of memory for a 4 KiB page");
  std::memset(p, 0, kIdentityBytes);
  return {static_cast<std::byte*>(p), &free_page};
}

std::vector<std::uint8_t> encode_blob(const MooncakeBlob& blob) {
  codec::ByteWriter w;
  w.u16(kBlobVersion);
  w.u64(blob.identity_ptr);
  w.u64(blob.epochs_ptr);
  w.u64(blob.ready_ptr);
  return w.take();
}

MooncakeBlob decode_blob(std::span<const std::uint8_t> blob) {
  codec::ByteReader r(blob, "Mooncake backend_blob");
  const std::uint16_t version = r.u16("version");
  if (version != kBlobVersion) {
    r.fail("version", "version " + std::to_string(version) + " is not the supported " +
                          std::to_string(kBlobVersion));
  }
  const std::uint64_t ptr = r.u64("identity_ptr");
  const std::uint64_t epochs = r.u64("epochs_ptr");
  const std::uint64_t ready = r.u64("ready_ptr");
  r.expect_end();
  if (ptr == 0) r.fail("identity_ptr", "null identity page address");
  if (ptr + kIdentityBytes < ptr) r.fail("identity_ptr", hex(ptr) + " + 4096 overflows");
  if (epochs == 0 || epochs % 8 != 0) {
    r.fail("epochs_ptr", "page epoch table address " + hex(epochs) + " is null or unaligned");
  }
  if (ready == 0 || ready % 4 != 0) {
    r.fail("ready_ptr", "layer readiness table address " + hex(ready) + " is null or unaligned");
  }
  // Their ends (epochs + 8 * num_pages, ready + 4 * num_pages) are checked
  // against the layout by MooncakeKVTransferInfo::decode.
  return MooncakeBlob{ptr, epochs, ready};
}

void write_identity(std::byte* page, const rma::RmaRegionInfo& region) {
  const std::vector<std::uint8_t> payload = region.encode();
  codec::ByteWriter w;
  w.u64(kIdentityMagic);
  w.bytes(payload);
  w.u32(codec::crc32c(w.data()));
  if (w.data().size() > kIdentityBytes) {
    throw Error(StatusCode::kInvalidArgument,
                "Mooncake descriptor of " + std::to_string(w.data().size()) +
                    " bytes exceeds the identity page of " + std::to_string(kIdentityBytes));
  }
  std::memcpy(page, w.data().data(), w.data().size());
}

rma::RmaRegionInfo read_identity(std::span<const std::uint8_t> bytes, const std::string& where) {
  try {
    codec::ByteReader r(bytes, "Mooncake identity page");
    if (r.u64("magic") != kIdentityMagic) r.fail("magic", "not an mstar-kv identity page");
    const auto payload = r.bytes("descriptor", kIdentityBytes - 16);
    const std::size_t used = 8 + 4 + payload.size();
    const std::uint32_t crc = r.u32("crc");
    if (crc != codec::crc32c(bytes.first(used))) r.fail("crc", "checksum mismatch");
    return rma::RmaRegionInfo::decode(payload);
  } catch (const Error& e) {
    throw Error(StatusCode::kPermissionDenied,
                "the descriptor's identity page " + where +
                    " does not hold an mstar-kv descriptor (forged or stale): " + e.what());
  }
}

// A registered scratch page for one identity read; unregistered when the
// read's batch has completed and the connect that waited for it let go.
// Counted in live_scratch_ (shutdown waits until none is left, so that no
// registration outlives it on a shared handle). Created under api_mu_.
class MooncakeBackend::Scratch {
 public:
  Scratch(MooncakeBackend& backend, PagePtr page) : backend_(backend), page_(std::move(page)) {
    std::lock_guard<std::mutex> lk(backend_.mu_);
    ++backend_.live_scratch_;
  }
  ~Scratch() {
    backend_.unregister(page_.get());
    std::lock_guard<std::mutex> lk(backend_.mu_);
    --backend_.live_scratch_;
    backend_.cv_.notify_all();
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::byte* data() const noexcept { return page_.get(); }

 private:
  MooncakeBackend& backend_;
  PagePtr page_;
};

std::shared_ptr<void> MooncakeBackend::scratch_page(std::byte** data) {
  std::shared_lock<std::shared_mutex> api(api_mu_);
  if (engine_ == nullptr || dead()) throw refusal();
  auto page = alloc_page();
  std::byte* raw = page.get();
  if (api_->registerLocalMemory(engine_, raw, kIdentityBytes, options_.location.c_str(), 0) != 0) {
    throw Error(StatusCode::kInternal, "Mooncake registerLocalMemory of a 4 KiB scratch page failed");
  }
  auto s = std::make_shared<Scratch>(*this, std::move(page));
  *data = s->data();
  return s;
}

// ---- a connected peer --------------------------------------------------------

namespace {

// Page epochs around one batch (epochs.hpp): the owner's epoch words of the
// batch's pages are read into registered scratch pages (512 words each, one
// page at a time) and compared, then the data reads run, then the words are
// read and compared again. One request batch is outstanding at a time; the
// completion runs once, after the last one finished, so nothing lands after
// it. abort() stops the stage in flight and skips the rest.
class EpochCheckedRead final : public rma::RmaOperation,
                               public std::enable_shared_from_this<EpochCheckedRead> {
 public:
  static constexpr std::size_t kWordsPerScratch = kIdentityBytes / 8;

  EpochCheckedRead(MooncakeBackend& backend, McSegmentId segment, std::string who,
                   std::uint64_t data_ptr, std::uint64_t epochs_ptr, std::byte* local_base,
                   std::vector<rma::RmaRead> reads, rma::RmaCompletion done,
                   std::shared_ptr<std::atomic<bool>> failed, rma::RmaEpochCheck check)
      : backend_(backend), segment_(segment), who_(std::move(who)), data_ptr_(data_ptr),
        epochs_ptr_(epochs_ptr), local_base_(local_base), reads_(std::move(reads)),
        done_(std::move(done)), failed_(std::move(failed)), check_(std::move(check)),
        words_(check_.pages.size(), 0) {
    std::byte* data = nullptr;
    scratch_keep_ = backend_.scratch_page(&data);  // caller's thread: may register
    scratch_ = data;
  }

  void start() { post_words(0, 0); }

  void abort() noexcept override {
    std::shared_ptr<rma::RmaOperation> cur;
    {
      std::lock_guard<std::mutex> lk(mu_);
      aborted_ = true;
      cur = current_;
    }
    if (cur) cur->abort();
  }

 private:
  // Phase 0 is before the data reads, 1 after; chunk k holds words
  // [k * kWordsPerScratch, ...) of check_.pages.
  void post_words(int phase, std::size_t k) {
    std::vector<rma::RmaRead> words;
    const std::size_t first = k * kWordsPerScratch;
    const std::size_t end = std::min(check_.pages.size(), first + kWordsPerScratch);
    for (std::size_t i = first; i < end; ++i) {
      words.push_back({std::uint64_t{check_.pages[i]} * 8, (i - first) * 8, 8});
    }
    auto self = shared_from_this();
    stage([&] {
      return backend_.post(segment_, who_, epochs_ptr_, scratch_, words,
                           [self, phase, k](Status st) { self->on_words(phase, k, std::move(st)); },
                           failed_, scratch_keep_);
    });
  }

  void on_words(int phase, std::size_t k, Status st) {
    if (!st.is_ok()) return finish(std::move(st));
    std::atomic_thread_fence(std::memory_order_acquire);
    const std::size_t first = k * kWordsPerScratch;
    const std::size_t end = std::min(check_.pages.size(), first + kWordsPerScratch);
    std::memcpy(words_.data() + first, scratch_, (end - first) * 8);
    if (is_aborted()) return finish(Status(StatusCode::kCancelled, "aborted"));
    if (end < check_.pages.size()) return post_words(phase, k + 1);
    for (std::size_t i = 0; i < check_.pages.size(); ++i) {
      if (words_[i] != check_.epoch) {
        return finish(stale_page_status(check_.pages[i], words_[i], check_.epoch,
                                        phase == 0 ? "before the copy" : "during the copy"));
      }
    }
    if (phase == 1) return finish(Status::ok());
    auto self = shared_from_this();
    stage([&] {
      return backend_.post(segment_, who_, data_ptr_, local_base_, reads_,
                           [self](Status s) {
                             if (!s.is_ok()) return self->finish(std::move(s));
                             if (self->is_aborted()) {
                               return self->finish(Status(StatusCode::kCancelled, "aborted"));
                             }
                             self->post_words(1, 0);
                           },
                           failed_, nullptr);
    });
  }

  // Posts the next stage (nothing else is outstanding); a refusal (the
  // backend stopped or died) finishes the read.
  template <typename Post>
  void stage(Post&& post) {
    std::shared_ptr<rma::RmaOperation> op;
    try {
      op = post();
    } catch (const Error& e) {
      return finish(e.status());
    }
    bool abort_now = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      current_ = op;
      abort_now = aborted_;
    }
    if (abort_now) op->abort();
  }

  bool is_aborted() {
    std::lock_guard<std::mutex> lk(mu_);
    return aborted_;
  }

  void finish(Status st) {
    rma::RmaCompletion done;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (finished_) return;
      finished_ = true;
      done = std::move(done_);
      current_.reset();
    }
    done(std::move(st));
  }

  MooncakeBackend& backend_;
  const McSegmentId segment_;
  const std::string who_;
  const std::uint64_t data_ptr_;
  const std::uint64_t epochs_ptr_;
  std::byte* const local_base_;
  const std::vector<rma::RmaRead> reads_;
  rma::RmaCompletion done_ MSTAR_KV_GUARDED_BY(mu_);
  const std::shared_ptr<std::atomic<bool>> failed_;
  const rma::RmaEpochCheck check_;
  std::vector<std::uint64_t> words_;  // the owner's epochs of check_.pages
  std::shared_ptr<void> scratch_keep_;
  std::byte* scratch_ = nullptr;
  std::mutex mu_;
  bool aborted_ MSTAR_KV_GUARDED_BY(mu_) = false;
  bool finished_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::shared_ptr<rma::RmaOperation> current_ MSTAR_KV_GUARDED_BY(mu_);
};

class MooncakePeer final : public rma::RmaPeer {
 public:
  MooncakePeer(MooncakeBackend& backend, McSegmentId segment, rma::RmaRegionInfo served,
               std::byte* local_base)
      : backend_(backend),
        segment_(segment),
        served_(std::move(served)),
        local_base_(local_base),
        failed_(std::make_shared<std::atomic<bool>>(false)) {}

  void verify(const rma::RmaRegionInfo& claimed) const override {
    rma::verify_region(served_, claimed);
  }

  bool failed() const noexcept override {
    return failed_->load(std::memory_order_acquire) || backend_.dead();
  }

  std::shared_ptr<rma::RmaOperation> post_reads(std::vector<rma::RmaRead> reads,
                                                rma::RmaCompletion done,
                                                rma::RmaEpochCheck check) override {
    if (check.epoch != 0 && !check.pages.empty()) {
      auto op = std::make_shared<EpochCheckedRead>(
          backend_, segment_, "'" + served_.entity_id + "' at " + served_.session_id,
          served_.data_ptr, decode_blob(served_.backend_blob).epochs_ptr, local_base_,
          std::move(reads), std::move(done), failed_, std::move(check));
      op->start();
      return op;
    }
    return backend_.post(segment_, "'" + served_.entity_id + "' at " + served_.session_id,
                         served_.data_ptr, local_base_, reads, std::move(done), failed_,
                         nullptr);
  }

  std::unique_ptr<LayerWatch> watch_layers(std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                           std::uint32_t num_layers) override {
    const MooncakeBlob blob = decode_blob(served_.backend_blob);
    return make_layer_watch(backend_, segment_,
                            "'" + served_.entity_id + "' at " + served_.session_id,
                            blob.epochs_ptr, blob.ready_ptr, failed_, std::move(pages), epoch,
                            num_layers);
  }

 private:
  MooncakeBackend& backend_;
  const McSegmentId segment_;
  const rma::RmaRegionInfo served_;
  std::byte* const local_base_;
  const std::shared_ptr<std::atomic<bool>> failed_;
};

}  // namespace

// ---- connecting ------------------------------------------------------------------

std::shared_ptr<rma::RmaPeer> MooncakeBackend::connect(const rma::RmaRegionInfo& remote,
                                                       std::chrono::milliseconds timeout) {
  const std::uint64_t identity_ptr = decode_blob(remote.backend_blob).identity_ptr;
  const std::string who = "peer '" + remote.entity_id + "' at " + remote.session_id;
  const auto deadline = Clock::now() + timeout;
  McSegmentId segment = -1;
  std::shared_ptr<Scratch> scratch;
  {
    std::shared_lock<std::shared_mutex> api(api_mu_);
    if (engine_ == nullptr || dead()) throw refusal();
    // Mooncake caches a segment by name; refresh it, so that a new owner at
    // an old session id is reached (openSegmentNoCache where available).
    segment = api_->openSegmentNoCache != nullptr
                  ? api_->openSegmentNoCache(engine_, remote.session_id.c_str())
                  : api_->openSegment(engine_, remote.session_id.c_str());
    if (segment < 0) {
      throw Error(StatusCode::kPeerFailure,
                  "Mooncake openSegment('" + remote.session_id + "') returned " +
                      std::to_string(segment) + ": " + who +
                      " is unreachable or not a Mooncake engine with this metadata (" +
                      (shared_ ? std::string("the application's engine's")
                               : "'" + options_.metadata + "'") +
                      ")");
    }
    auto page = alloc_page();
    std::byte* raw = page.get();
    if (api_->registerLocalMemory(engine_, raw, kIdentityBytes, options_.location.c_str(), 0) !=
        0) {
      throw Error(StatusCode::kInternal, "Mooncake registerLocalMemory of a 4 KiB scratch page failed");
    }
    scratch = std::make_shared<Scratch>(*this, std::move(page));
  }

  // Read the owner's identity page into the scratch page.
  struct Wait {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<Status> status;
  };
  auto wait = std::make_shared<Wait>();
  const rma::RmaRead read{0, 0, kIdentityBytes};
  auto op = post(segment, who, identity_ptr, scratch->data(), std::span(&read, 1),
                 [wait](Status st) {
                   std::lock_guard<std::mutex> lk(wait->mu);
                   wait->status = std::move(st);
                   wait->cv.notify_all();
                 },
                 std::make_shared<std::atomic<bool>>(false), scratch);
  Status st;
  {
    std::unique_lock<std::mutex> lk(wait->mu);
    if (!wait->cv.wait_until(lk, deadline, [&] { return wait->status.has_value(); })) {
      lk.unlock();
      op->abort();  // the scratch page lives until the batch completes
      throw Error(StatusCode::kTimeout, who + " did not answer the descriptor check in " +
                                            std::to_string(timeout.count()) + " ms");
    }
    st = *wait->status;
  }
  if (!st.is_ok()) {
    // Mooncake cannot tell a dead owner from an address it does not serve.
    throw Error(StatusCode::kPeerFailure,
                who + " did not serve the descriptor's identity page " + hex(identity_ptr) +
                    ": the owner is gone, or the descriptor is stale or forged: " +
                    st.message());
  }
  // Parse what the owner serves (untrusted bytes).
  const rma::RmaRegionInfo served = read_identity(
      std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(scratch->data()),
                                    kIdentityBytes),
      hex(identity_ptr) + " at " + who);
  return std::make_shared<MooncakePeer>(*this, segment, served, cache_->base());
}

}  // namespace mstar::kv::mooncake
