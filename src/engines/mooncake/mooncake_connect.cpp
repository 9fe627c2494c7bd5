// Copyright mstar-kv authors.
//
// The Mooncake backend's descriptor side: the backend_blob and identity page
// codecs, and connect(), which opens a peer's segment and checks the
// descriptor against the identity page the peer serves before any page read.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "core/codec.hpp"
#include "mooncake_backend.hpp"
#include "mooncake_readiness.hpp"
#include "mooncake_words.hpp"
#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

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

PagePtr alloc_page(std::size_t bytes) {
  const std::size_t size =
      (std::max<std::size_t>(bytes, 1) + kIdentityBytes - 1) / kIdentityBytes * kIdentityBytes;
  void* p = std::aligned_alloc(kIdentityBytes, size);
  if (p == nullptr) {
    throw Error(StatusCode::kInternal,
                "out of memory for " + std::to_string(size) + " bytes of scratch pages");
  }
  std::memset(p, 0, size);
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

namespace {

// Mooncake's C API is C++ inside: a call from a noexcept path must not let
// an exception escape (std::terminate).
void unregister_noexcept(const MooncakeApi& api, McEngine engine, void* addr,
                         const Logger& log) noexcept {
  try {
    if (api.unregisterLocalMemory(engine, addr) != 0) {
      log.warn("mooncake: unregisterLocalMemory of a scratch page failed");
    }
  } catch (...) {
    log.error("mooncake: unregisterLocalMemory of a scratch page threw");
  }
}

}  // namespace

// A registered scratch page: unregistered when its last holder lets go
// (unless shutdown() did it first), then freed.
class MooncakeBackend::Scratch {
 public:
  Scratch(std::shared_ptr<ScratchRegistry> registry, PagePtr page)
      : registry_(std::move(registry)), page_(std::move(page)) {}
  ~Scratch() {
    std::lock_guard<std::mutex> lk(registry_->mu);
    if (registry_->engine != nullptr && registry_->pages.erase(page_.get()) > 0) {
      unregister_noexcept(*registry_->api, registry_->engine, page_.get(), registry_->log);
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::byte* data() const noexcept { return page_.get(); }

 private:
  std::shared_ptr<ScratchRegistry> registry_;
  PagePtr page_;
};

std::shared_ptr<MooncakeBackend::Scratch> MooncakeBackend::new_scratch(std::size_t bytes) {
  // The Scratch exists before the registration and is listed first, so that
  // it unregisters the page in every case (shutdown() may run in between:
  // api_mu_ is held shared here, so it cannot, but the order costs nothing).
  const std::size_t size = (bytes + kIdentityBytes - 1) / kIdentityBytes * kIdentityBytes;
  auto s = std::make_shared<Scratch>(scratch_, alloc_page(size));
  void* raw = s->data();
  {
    std::lock_guard<std::mutex> lk(scratch_->mu);
    scratch_->pages.insert(raw);
  }
  if (api_->registerLocalMemory(engine_, raw, size, options_.location.c_str(), 0) != 0) {
    std::lock_guard<std::mutex> lk(scratch_->mu);
    scratch_->pages.erase(raw);
    throw Error(StatusCode::kInternal, "Mooncake registerLocalMemory of " + std::to_string(size) +
                                           " bytes of scratch pages failed");
  }
  return s;
}

std::shared_ptr<void> MooncakeBackend::scratch(std::size_t bytes, std::byte** data) {
  std::shared_lock<std::shared_mutex> api(api_mu_);
  if (engine_ == nullptr || dead()) throw refusal();
  auto s = new_scratch(bytes);
  *data = s->data();
  return s;
}

void MooncakeBackend::release_scratch() noexcept {
  std::lock_guard<std::mutex> lk(scratch_->mu);
  if (scratch_->engine != nullptr) {
    for (const void* p : scratch_->pages) {
      unregister_noexcept(*api_, scratch_->engine, const_cast<void*>(p), options_.log);
    }
  }
  scratch_->pages.clear();
  scratch_->engine = nullptr;
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
  EpochCheckedRead(MooncakeBackend& backend, McSegmentId segment, std::string who,
                   std::uint64_t data_ptr, std::uint64_t epochs_ptr, std::byte* local_base,
                   std::vector<rma::RmaRead> reads, rma::RmaCompletion done,
                   std::shared_ptr<std::atomic<bool>> failed, rma::RmaEpochCheck check)
      : backend_(backend),
        segment_(segment),
        who_(std::move(who)),
        data_ptr_(data_ptr),
        epochs_ptr_(epochs_ptr),
        local_base_(local_base),
        reads_(std::move(reads)),
        done_(std::move(done)),
        failed_(std::move(failed)),
        check_(std::move(check)),
        words_(word_reads(check_.pages, 8)) {
    std::byte* data = nullptr;
    scratch_keep_ = backend_.scratch(words_.bytes, &data);  // caller's thread: may register
    scratch_ = data;
  }

  void start() { post_words(0); }

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
  // Phase 0 is before the data reads, 1 after: the epochs of check_.pages,
  // in runs (mooncake_words.hpp), into the scratch memory.
  void post_words(int phase) {
    auto self = shared_from_this();
    stage([&] {
      return backend_.post(
          segment_, who_, epochs_ptr_, scratch_, words_.reads,
          [self, phase](Status st) { self->on_words(phase, std::move(st)); }, failed_,
          scratch_keep_);
    });
  }

  void on_words(int phase, Status st) {
    if (!st.is_ok()) return finish(std::move(st));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (is_aborted()) return finish(Status(StatusCode::kCancelled, "aborted"));
    Status words = check_epoch_words(words_, check_.pages, {scratch_, words_.bytes}, check_.epoch,
                                     phase == 0 ? "before the copy" : "during the copy");
    if (!words.is_ok()) return finish(std::move(words));
    if (phase == 1) return finish(Status::ok());
    auto self = shared_from_this();
    stage([&] {
      return backend_.post(
          segment_, who_, data_ptr_, local_base_, reads_,
          [self](Status s) {
            if (!s.is_ok()) return self->finish(std::move(s));
            if (self->is_aborted()) {
              return self->finish(Status(StatusCode::kCancelled, "aborted"));
            }
            self->post_words(1);
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
    } catch (const std::exception& e) {
      return finish(Status(StatusCode::kInternal, e.what()));
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

  // Runs once no stage is outstanding (stages run one after another). The
  // scratch page goes with it: whoever still holds this operation (the
  // engine's in-flight entry, an abort list) holds no registration.
  void finish(Status st) {
    rma::RmaCompletion done;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (finished_) return;
      finished_ = true;
      done = std::move(done_);
      current_.reset();
    }
    scratch_keep_.reset();
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
  const WordReads words_;  // the owner's epochs of check_.pages
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
                         served_.data_ptr, local_base_, reads, std::move(done), failed_, nullptr);
  }

  std::unique_ptr<LayerWatch> watch_layers(std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                           std::uint32_t num_layers) override {
    const MooncakeBlob blob = decode_blob(served_.backend_blob);
    return make_layer_watch(backend_, segment_,
                            "'" + served_.entity_id + "' at " + served_.session_id, blob.epochs_ptr,
                            blob.ready_ptr, failed_, std::move(pages), epoch, num_layers);
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
  if (!remote.layer_regions.empty()) {
    throw Error(StatusCode::kNotSupported,
                "the C++ Mooncake engine reads caches of one region; peer '" + remote.entity_id +
                    "' serves " + std::to_string(remote.layer_regions.size()) +
                    " (one per layer): read it with the wheel engine "
                    "(mstar_kv.MooncakeKVTransferEngine over a mooncake.engine.TransferEngine)");
  }
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
    scratch = new_scratch(kIdentityBytes);
  }

  // Read the owner's identity page into the scratch page.
  struct Wait {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<Status> status;
  };
  auto wait = std::make_shared<Wait>();
  const rma::RmaRead read{0, 0, kIdentityBytes};
  auto op = post(
      segment, who, identity_ptr, scratch->data(), std::span(&read, 1),
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
                    ": the owner is gone, or the descriptor is stale or forged: " + st.message());
  }
  // Parse what the owner serves (untrusted bytes).
  const rma::RmaRegionInfo served =
      read_identity(std::span<const std::uint8_t>(
                        reinterpret_cast<const std::uint8_t*>(scratch->data()), kIdentityBytes),
                    hex(identity_ptr) + " at " + who);
  return std::make_shared<MooncakePeer>(*this, segment, served, cache_->base());
}

}  // namespace mstar::kv::mooncake
