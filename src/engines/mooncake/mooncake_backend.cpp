// Copyright mstar-kv authors.
#include "mooncake_backend.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include "core/codec.hpp"
#include "mstar/kv/planner.hpp"
#include "engines/rma/rma_engine.hpp"

namespace mstar::kv::engines::mooncake {

using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint16_t kBlobVersion = 1;

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

void free_page(void* p) { std::free(p); }

std::unique_ptr<std::byte, void (*)(void*)> alloc_page() {
  void* p = std::aligned_alloc(kIdentityBytes, kIdentityBytes);
  if (p == nullptr) throw Error(StatusCode::kInternal, "out of memory for a 4 KiB page");
  std::memset(p, 0, kIdentityBytes);
  return {static_cast<std::byte*>(p), &free_page};
}

// Host part of "host:port", "[v6]:port" or "host".
std::string host_of(const std::string& s) {
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    return close == std::string::npos ? s : s.substr(0, close + 1);
  }
  const auto colon = s.find(':');
  if (colon != std::string::npos && s.find(':', colon + 1) == std::string::npos) {
    return s.substr(0, colon);
  }
  return s;
}

// Mooncake's Status::Code from submitTransfer, as our StatusCode.
StatusCode map_code(int code) {
  if (code == 2) return StatusCode::kRetryLater;  // TooManyRequests
  if (code >= 100 && code < 300) return StatusCode::kPeerFailure;  // network, metadata
  return StatusCode::kInternal;
}

}  // namespace

std::vector<std::uint8_t> encode_blob(std::uint64_t identity_ptr) {
  codec::ByteWriter w;
  w.u16(kBlobVersion);
  w.u64(identity_ptr);
  return w.take();
}

std::uint64_t decode_blob(std::span<const std::uint8_t> blob) {
  codec::ByteReader r(blob, "Mooncake backend_blob");
  const std::uint16_t version = r.u16("version");
  if (version != kBlobVersion) {
    r.fail("version", "version " + std::to_string(version) + " is not the supported " +
                          std::to_string(kBlobVersion));
  }
  const std::uint64_t ptr = r.u64("identity_ptr");
  r.expect_end();
  if (ptr == 0) r.fail("identity_ptr", "null identity page address");
  if (ptr + kIdentityBytes < ptr) r.fail("identity_ptr", hex(ptr) + " + 4096 overflows");
  return ptr;
}

// ---- a batch in flight -------------------------------------------------------

struct MooncakeBackend::Batch final : rma::RmaOperation {
  // Set by post(), then owned by the progress thread.
  McSegmentId segment = -1;
  std::vector<McTransferRequest> req;
  rma::RmaCompletion done;
  std::shared_ptr<std::atomic<bool>> peer_failed;
  std::shared_ptr<void> keepalive;
  std::string peer_name;
  McBatchId id = kInvalidBatch;  // allocated by the progress thread
  std::size_t submitted = 0;     // requests handed to Mooncake
  std::size_t next = 0;          // first submitted task not yet seen final
  bool stop_submitting = false;  // aborted or failed: submit nothing more
  Status error;                  // first failure
  std::optional<Clock::time_point> abort_seen;
  std::atomic<bool> abort_requested{false};

  void abort() noexcept override { abort_requested.store(true, std::memory_order_release); }
};

// A registered scratch page for one identity read; unregistered when the
// read's batch has completed and the connect that waited for it let go.
class MooncakeBackend::Scratch {
 public:
  Scratch(MooncakeBackend& backend, std::unique_ptr<std::byte, void (*)(void*)> page)
      : backend_(backend), page_(std::move(page)) {}
  ~Scratch() { backend_.unregister(page_.get()); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::byte* data() const noexcept { return page_.get(); }

 private:
  MooncakeBackend& backend_;
  std::unique_ptr<std::byte, void (*)(void*)> page_;
};

// ---- a connected peer --------------------------------------------------------

namespace {

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
                                                rma::RmaCompletion done) override {
    return backend_.post(segment_, "'" + served_.entity_id + "' at " + served_.session_id,
                         served_.data_ptr, local_base_, reads, std::move(done), failed_,
                         nullptr);
  }

 private:
  MooncakeBackend& backend_;
  const McSegmentId segment_;
  const rma::RmaRegionInfo served_;
  std::byte* const local_base_;
  const std::shared_ptr<std::atomic<bool>> failed_;
};

}  // namespace

// ---- construction and teardown ----------------------------------------------

MooncakeBackend::MooncakeBackend(std::shared_ptr<KVCache> cache,
                                 const MooncakeOptions& options,
                                 const std::string& entity_id,
                                 const std::string& my_session_id)
    : cache_(std::move(cache)), options_(options), identity_(nullptr, &free_page) {
  if (!cache_) throw Error(StatusCode::kInvalidArgument, "the Mooncake engine needs a cache");
  if (entity_id.size() > rma::RmaRegionInfo::kMaxIdBytes ||
      my_session_id.size() > rma::RmaRegionInfo::kMaxIdBytes) {
    throw Error(StatusCode::kInvalidArgument,
                "entity id / session id of " +
                    std::to_string(std::max(entity_id.size(), my_session_id.size())) +
                    " bytes exceeds the limit of " +
                    std::to_string(rma::RmaRegionInfo::kMaxIdBytes));
  }
  const bool p2p = options_.metadata == "P2PHANDSHAKE";
  if (!p2p && my_session_id.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "Mooncake metadata '" + options_.metadata +
                    "' needs my_session_id (this process's segment name); only "
                    "P2PHANDSHAKE derives it");
  }
  lib_ = std::make_unique<MooncakeLibrary>(options_.library_path);
  api_ = &lib_->api();

  // Read by Mooncake when its engine / TCP transport is created; a user's
  // own setting wins (overwrite = 0).
  ::setenv("MC_TCP_ENABLE_CONNECTION_POOL", "1", 0);
  ::setenv("MC_LOG_LEVEL", "WARNING", 0);
  // Mooncake's TCP transport queues at most this many requests per peer and
  // fails the rest; stay within it.
  if (const char* q = std::getenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"); q != nullptr) {
    const long v = std::strtol(q, nullptr, 10);
    if (v >= 1 && v <= 65535) window_ = static_cast<std::size_t>(v);
  }

  std::string server_name;
  if (p2p) {
    // my_session_id names the host only in its "HOST:PORT" form; anything
    // else is a label (the port is Mooncake's choice in P2P mode).
    const bool host_port = my_session_id.find(':') != std::string::npos;
    server_name = !options_.host.empty() ? options_.host
                  : host_port            ? host_of(my_session_id)
                                         : std::string("127.0.0.1");
  } else {
    server_name = my_session_id;
  }
  engine_ = api_->createTransferEngine(options_.metadata.c_str(), server_name.c_str(),
                                       server_name.c_str(), 0, 0);
  if (engine_ == nullptr) {
    throw Error(StatusCode::kUnavailable,
                "Mooncake createTransferEngine(metadata '" + options_.metadata +
                    "', server '" + server_name + "') failed (see Mooncake's log)");
  }
  try {
    if (api_->installTransport(engine_, options_.protocol.c_str(), nullptr) == nullptr) {
      throw Error(StatusCode::kUnavailable,
                  "Mooncake installTransport('" + options_.protocol + "') failed");
    }
    std::string session = my_session_id;
    if (p2p) {
      char buf[256] = {};
      if (api_->getLocalIpAndPort(engine_, buf, sizeof buf) != 0 || buf[0] == '\0') {
        throw Error(StatusCode::kUnavailable, "Mooncake getLocalIpAndPort failed");
      }
      session = buf;
    }
    const KVLayout& layout = cache_->layout();
    if (api_->registerLocalMemory(engine_, cache_->base(), layout.total_bytes(),
                                  options_.location.c_str(), 1) != 0) {
      throw Error(StatusCode::kUnavailable,
                  "Mooncake registerLocalMemory of the " + std::to_string(layout.total_bytes()) +
                      "-byte cache at location '" + options_.location + "' failed");
    }
    cache_registered_ = true;

    identity_ = alloc_page();
    region_.entity_id = entity_id;
    region_.session_id = session;
    region_.data_ptr = reinterpret_cast<std::uintptr_t>(cache_->base());
    region_.size = layout.total_bytes();
    region_.layout = layout;
    region_.generation = rma::new_generation();
    region_.backend_blob = encode_blob(reinterpret_cast<std::uintptr_t>(identity_.get()));
    const std::vector<std::uint8_t> payload = region_.encode();
    codec::ByteWriter w;
    w.u64(kIdentityMagic);
    w.bytes(payload);
    w.u32(codec::crc32c(w.data()));
    if (w.data().size() > kIdentityBytes) {
      throw Error(StatusCode::kInvalidArgument,
                  "Mooncake descriptor of " + std::to_string(w.data().size()) +
                      " bytes exceeds the identity page of " + std::to_string(kIdentityBytes));
    }
    std::memcpy(identity_.get(), w.data().data(), w.data().size());
    if (api_->registerLocalMemory(engine_, identity_.get(), kIdentityBytes,
                                  options_.location.c_str(), 1) != 0) {
      throw Error(StatusCode::kUnavailable, "Mooncake registerLocalMemory of the identity page failed");
    }
    identity_registered_ = true;
    progress_ = std::thread([this] { progress_loop(); });
  } catch (...) {
    if (cache_registered_) api_->unregisterLocalMemory(engine_, cache_->base());
    api_->destroyTransferEngine(engine_);
    engine_ = nullptr;
    throw;
  }
}

MooncakeBackend::~MooncakeBackend() { shutdown(); }

void MooncakeBackend::shutdown() noexcept {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    for (auto& b : batches_) b->abort();
  }
  cv_.notify_all();
  // The progress thread exits once every batch completed (or was failed by a
  // tear-down after the abort grace).
  if (progress_.joinable()) progress_.join();
  std::unique_lock<std::shared_mutex> api(api_mu_);
  if (engine_ == nullptr) return;
  if (cache_registered_) api_->unregisterLocalMemory(engine_, cache_->base());
  if (identity_registered_) api_->unregisterLocalMemory(engine_, identity_.get());
  cache_registered_ = identity_registered_ = false;
  api_->destroyTransferEngine(engine_);
  engine_ = nullptr;
}

void MooncakeBackend::unregister(void* addr) noexcept {
  std::shared_lock<std::shared_mutex> api(api_mu_);
  if (engine_ != nullptr) api_->unregisterLocalMemory(engine_, addr);
}

std::string MooncakeBackend::dead_message() const {
  std::lock_guard<std::mutex> lk(mu_);
  return "the Mooncake engine was torn down (" + dead_reason_ +
         "); create a new engine";
}

// ---- posting -----------------------------------------------------------------

std::shared_ptr<rma::RmaOperation> MooncakeBackend::post(
    McSegmentId segment, const std::string& peer_name, std::uint64_t remote_base,
    std::byte* local_base, std::span<const rma::RmaRead> reads, rma::RmaCompletion done,
    std::shared_ptr<std::atomic<bool>> peer_failed, std::shared_ptr<void> keepalive) {
  if (reads.empty()) throw Error(StatusCode::kInvalidArgument, "empty Mooncake batch");
  // Mooncake's TCP transport moves one request on one connection; pieces of
  // at most kMaxRequestBytes let its lanes share a large span.
  const std::vector<rma::RmaRead> pieces = split_spans(reads, kMaxRequestBytes);
  auto b = std::make_shared<Batch>();
  b->segment = segment;
  b->req.resize(pieces.size());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    b->req[i].opcode = kOpcodeRead;
    b->req[i].source = local_base + pieces[i].local_offset;
    b->req[i].target_id = segment;
    b->req[i].target_offset = remote_base + pieces[i].remote_offset;
    b->req[i].length = pieces[i].length;
  }
  b->done = std::move(done);
  b->peer_failed = std::move(peer_failed);
  b->keepalive = std::move(keepalive);
  b->peer_name = peer_name;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Checked under mu_: tear_down() empties batches_ under it for the last
    // time, and nothing polls a batch queued after that.
    if (!dead_reason_.empty()) {
      throw Error(StatusCode::kUnavailable,
                  "the Mooncake engine was torn down (" + dead_reason_ + "); create a new engine");
    }
    if (stopping_) throw Error(StatusCode::kShutdown, "the Mooncake backend is shut down");
    batches_.push_back(b);
    ++arrivals_;
  }
  cv_.notify_all();
  return b;
}

// ---- the progress thread ------------------------------------------------------

bool MooncakeBackend::poll(Batch& b, std::size_t& outstanding) {
  bool moved = false;
  while (b.next < b.submitted) {
    McTransferStatus st{};
    const int rc = api_->getTransferStatus(engine_, b.id, b.next, &st);
    if (rc != 0) {
      // Only a task Mooncake never took (out of range after a failed
      // submit) answers so: it cannot write, so it counts as finished.
      if (b.error.is_ok()) {
        b.error = Status(StatusCode::kInternal, "Mooncake getTransferStatus(task " +
                                                    std::to_string(b.next) + ") returned " +
                                                    status_code_name(rc));
      }
    } else if (!is_final(st.status)) {
      break;  // WAITING / PENDING / TIMEOUT: still in flight
    } else if (st.status == static_cast<int>(McTaskStatus::kFailed)) {
      if (b.error.is_ok()) {
        b.error = Status(StatusCode::kPeerFailure,
                         "Mooncake read " + std::to_string(b.next + 1) + " of " +
                             std::to_string(b.req.size()) + " from " + b.peer_name +
                             " FAILED (peer gone, or address not registered there)");
      }
      b.stop_submitting = true;
      b.peer_failed->store(true, std::memory_order_release);
    }
    ++b.next;
    if (outstanding > 0) --outstanding;
    moved = true;
  }
  return moved;
}

bool MooncakeBackend::submit_more(Batch& b, std::size_t& outstanding) {
  if (b.stop_submitting || b.submitted == b.req.size()) return false;
  if (b.id == kInvalidBatch) {
    b.id = api_->allocateBatchID(engine_, b.req.size());
    if (b.id == kInvalidBatch) {
      b.error = Status(StatusCode::kInternal,
                       "Mooncake allocateBatchID(" + std::to_string(b.req.size()) + ") failed");
      b.stop_submitting = true;
      return true;
    }
  }
  if (outstanding >= window_) return false;
  const std::size_t n = std::min(window_ - outstanding, b.req.size() - b.submitted);
  const int rc = api_->submitTransfer(engine_, b.id, b.req.data() + b.submitted, n);
  if (rc != 0) {
    b.error = Status(map_code(rc), "Mooncake submitTransfer of " + std::to_string(n) +
                                       " reads from " + b.peer_name + " returned " +
                                       status_code_name(rc));
    b.stop_submitting = true;
  }
  // After a failed submit Mooncake may hold some of the n: poll them all
  // (the ones it never took answer out-of-range and count as finished).
  b.submitted += n;
  outstanding += n;
  return true;
}

void MooncakeBackend::progress_loop() {
  int idle = 0;
  std::uint64_t seen_arrivals = 0;
  // Requests handed to Mooncake and not yet seen final, per peer segment.
  std::map<McSegmentId, std::size_t> outstanding;
  for (;;) {
    std::vector<std::shared_ptr<Batch>> work;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return !batches_.empty() || stopping_; });
      if (batches_.empty()) return;  // stopping, nothing left
      work = batches_;
      seen_arrivals = arrivals_;
    }
    std::vector<std::shared_ptr<Batch>> finished;
    std::string hung;
    bool moved = false;
    {
      std::shared_lock<std::shared_mutex> api(api_mu_);
      if (engine_ == nullptr) return;  // torn down (batches were failed then)
      const auto now = Clock::now();
      for (auto& b : work) {
        std::size_t& out = outstanding[b->segment];
        moved |= poll(*b, out);
        if (b->abort_requested.load(std::memory_order_acquire) && !b->stop_submitting) {
          b->stop_submitting = true;
          if (b->submitted < b->req.size() && b->error.is_ok()) {
            b->error = Status(StatusCode::kCancelled,
                              "aborted with " + std::to_string(b->req.size() - b->submitted) +
                                  " of " + std::to_string(b->req.size()) +
                                  " requests not submitted");
          }
        }
        moved |= submit_more(*b, out);
        const bool all_in = b->stop_submitting || b->submitted == b->req.size();
        if (all_in && b->next == b->submitted) {
          if (b->id != kInvalidBatch) {
            const int rc = api_->freeBatchID(engine_, b->id);
            if (rc != 0 && b->error.is_ok()) {
              // Every task was seen final, so nothing of it can still land;
              // the batch descriptor leaks inside Mooncake.
              b->error = Status(StatusCode::kInternal,
                                "Mooncake freeBatchID returned " + status_code_name(rc));
            }
          }
          finished.push_back(b);
        } else if (b->abort_requested.load(std::memory_order_acquire)) {
          if (!b->abort_seen) b->abort_seen = now;
          if (now - *b->abort_seen > std::chrono::milliseconds(options_.abort_grace_ms) &&
              hung.empty()) {
            hung = "reads from " + b->peer_name + " still in flight " +
                   std::to_string(options_.abort_grace_ms) +
                   " ms after they were aborted: the peer hangs";
          }
        }
      }
    }
    if (!finished.empty()) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        std::erase_if(batches_, [&](const std::shared_ptr<Batch>& b) {
          return std::find(finished.begin(), finished.end(), b) != finished.end();
        });
      }
      for (auto& b : finished) {
        auto done = std::move(b->done);
        done(b->error);
        b->keepalive.reset();
      }
    }
    if (!hung.empty()) {
      tear_down(hung);
      return;
    }
    // Pause between rounds so that polling does not take a core from
    // Mooncake's own threads: 20 us while requests finish, else backing off
    // (doubling) to 1 ms; a new batch or shutdown wakes the thread early.
    if (moved || !finished.empty()) idle = 0;
    const auto pause = std::chrono::microseconds(std::min(1000, 20 << std::min(idle, 6)));
    ++idle;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, pause, [&] { return arrivals_ != seen_arrivals || stopping_; });
  }
}

void MooncakeBackend::tear_down(const std::string& why) {
  {
    std::unique_lock<std::shared_mutex> api(api_mu_);
    if (engine_ != nullptr) {
      // Closes every connection and stops Mooncake's threads: after this no
      // request of ours can write any more. Registrations go with it.
      api_->destroyTransferEngine(engine_);
      engine_ = nullptr;
      cache_registered_ = identity_registered_ = false;
    }
  }
  std::vector<std::shared_ptr<Batch>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dead_reason_ = why;
    left.swap(batches_);
  }
  dead_.store(true, std::memory_order_release);
  std::fprintf(stderr, "mstar-kv mooncake: %s; Mooncake's engine was destroyed\n", why.c_str());
  for (auto& b : left) {
    b->peer_failed->store(true, std::memory_order_release);
    auto done = std::move(b->done);
    done(Status(StatusCode::kPeerFailure, why + "; the Mooncake engine was torn down"));
    b->keepalive.reset();
  }
}

// ---- connecting ------------------------------------------------------------------

std::shared_ptr<rma::RmaPeer> MooncakeBackend::connect(const rma::RmaRegionInfo& remote,
                                                       std::chrono::milliseconds timeout) {
  const std::uint64_t identity_ptr = decode_blob(remote.backend_blob);
  const std::string who = "peer '" + remote.entity_id + "' at " + remote.session_id;
  const auto deadline = Clock::now() + timeout;
  McSegmentId segment = -1;
  std::shared_ptr<Scratch> scratch;
  {
    std::shared_lock<std::shared_mutex> api(api_mu_);
    if (engine_ == nullptr) throw Error(StatusCode::kUnavailable, dead_message());
    // Mooncake caches a segment by name; refresh it, so that a new owner at
    // an old session id is reached (openSegmentNoCache where available).
    segment = api_->openSegmentNoCache != nullptr
                  ? api_->openSegmentNoCache(engine_, remote.session_id.c_str())
                  : api_->openSegment(engine_, remote.session_id.c_str());
    if (segment < 0) {
      throw Error(StatusCode::kPeerFailure,
                  "Mooncake openSegment('" + remote.session_id + "') returned " +
                      std::to_string(segment) + ": " + who +
                      " is unreachable or not a Mooncake engine with this metadata ('" +
                      options_.metadata + "')");
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
  const std::span<const std::uint8_t> bytes(
      reinterpret_cast<const std::uint8_t*>(scratch->data()), kIdentityBytes);
  rma::RmaRegionInfo served;
  try {
    codec::ByteReader r(bytes, "Mooncake identity page");
    if (r.u64("magic") != kIdentityMagic) r.fail("magic", "not an mstar-kv identity page");
    const auto payload = r.bytes("descriptor", kIdentityBytes - 16);
    const std::size_t used = 8 + 4 + payload.size();
    const std::uint32_t crc = r.u32("crc");
    if (crc != codec::crc32c(bytes.first(used))) r.fail("crc", "checksum mismatch");
    served = rma::RmaRegionInfo::decode(payload);
  } catch (const Error& e) {
    throw Error(StatusCode::kPermissionDenied,
                "the descriptor's identity page " + hex(identity_ptr) + " at " + who +
                    " does not hold an mstar-kv descriptor (forged or stale): " + e.what());
  }
  return std::make_shared<MooncakePeer>(*this, segment, std::move(served), cache_->base());
}

}  // namespace mstar::kv::engines::mooncake
