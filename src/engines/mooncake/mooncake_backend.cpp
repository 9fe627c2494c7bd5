// Copyright mstar-kv authors.
#include "mooncake_backend.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <utility>

#include "mstar/kv/core/planner.hpp"
#include "rma/rma_engine.hpp"

namespace mstar::kv::mooncake {

namespace {

// Mooncake reads its configuration from the environment when an engine and
// its TCP transport are created, and its C API takes none. The two variables
// this engine relies on (mooncake.hpp) are therefore set here, once, while
// the program loads (before main, so before any thread of a program linking
// the library; at import for the Python extension), and never by an engine:
// setenv beside running threads is a data race. A value the user set wins.
[[maybe_unused]] const bool kMooncakeEnvironment = [] {
  ::setenv("MC_TCP_ENABLE_CONNECTION_POOL", "1", 0);
  ::setenv("MC_LOG_LEVEL", "WARNING", 0);
  return true;
}();

}  // namespace

using Clock = std::chrono::steady_clock;

namespace {

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
  if (code == 2) return StatusCode::kRetryLater;                   // TooManyRequests
  if (code >= 100 && code < 300) return StatusCode::kPeerFailure;  // network, metadata
  return StatusCode::kInternal;
}

}  // namespace

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

// ---- construction and teardown ----------------------------------------------

MooncakeBackend::MooncakeBackend(std::shared_ptr<KVCache> cache, const MooncakeOptions& options,
                                 const std::string& entity_id, const std::string& my_session_id,
                                 McEngine shared_engine)
    : cache_(std::move(cache)), options_(options), identity_(nullptr, nullptr) {
  if (!cache_) throw Error(StatusCode::kInvalidArgument, "the Mooncake engine needs a cache");
  if (entity_id.size() > rma::RmaRegionInfo::kMaxIdBytes ||
      my_session_id.size() > rma::RmaRegionInfo::kMaxIdBytes) {
    throw Error(StatusCode::kInvalidArgument,
                "entity id / session id of " +
                    std::to_string(std::max(entity_id.size(), my_session_id.size())) +
                    " bytes exceeds the limit of " +
                    std::to_string(rma::RmaRegionInfo::kMaxIdBytes));
  }
  shared_ = shared_engine != nullptr;
  const bool p2p = options_.metadata == "P2PHANDSHAKE";
  if (!shared_ && !p2p && my_session_id.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "Mooncake metadata '" + options_.metadata +
                    "' needs my_session_id (this process's segment name); only "
                    "P2PHANDSHAKE derives it");
  }
  lib_ = std::make_unique<MooncakeLibrary>(options_.library_path);
  api_ = &lib_->api();
  scratch_ = std::make_shared<ScratchRegistry>();
  if (shared_) {
    if (const std::string other = lib_->other_global_copy(); !other.empty()) {
      throw Error(StatusCode::kInvalidArgument,
                  "the process already has Mooncake's C API loaded from '" + other +
                      "', but the engine loaded '" + lib_->path() +
                      "': a shared transfer_engine handle must be driven by the library "
                      "that created it; set mooncake_lib / MSTAR_KV_MOONCAKE_LIB to '" +
                      other + "'");
    }
  }
  // Mooncake's TCP transport queues at most this many requests per peer and
  // fails the rest; stay within it.
  if (const char* q = std::getenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"); q != nullptr) {
    const long v = std::strtol(q, nullptr, 10);
    if (v >= 1 && v <= 65535) window_ = static_cast<std::size_t>(v);
  }

  if (shared_) {
    engine_ = shared_engine;
  } else {
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
      throw Error(StatusCode::kUnavailable, "Mooncake createTransferEngine(metadata '" +
                                                options_.metadata + "', server '" + server_name +
                                                "') failed (see Mooncake's log)");
    }
  }
  try {
    if (!shared_ &&
        api_->installTransport(engine_, options_.protocol.c_str(), nullptr) == nullptr) {
      throw Error(StatusCode::kUnavailable,
                  "Mooncake installTransport('" + options_.protocol + "') failed");
    }
    std::string session = my_session_id;
    if (shared_ ? session.empty() : p2p) {
      char buf[256] = {};
      if (api_->getLocalIpAndPort(engine_, buf, sizeof buf) != 0 || buf[0] == '\0') {
        throw Error(StatusCode::kUnavailable, "Mooncake getLocalIpAndPort failed");
      }
      session = buf;
    }
    const KVLayout& layout = cache_->layout();
    if (api_->registerLocalMemory(engine_, cache_->base(), layout.total_bytes(),
                                  options_.location.c_str(), 1) != 0) {
      throw Error(
          StatusCode::kUnavailable,
          "Mooncake registerLocalMemory of the " + std::to_string(layout.total_bytes()) +
              "-byte cache at location '" + options_.location + "' failed" +
              (shared_ ? " (on the shared handle: is this memory registered there already?)" : ""));
    }
    cache_registered_ = true;

    identity_ = alloc_page();
    region_.entity_id = entity_id;
    region_.session_id = session;
    region_.data_ptr = reinterpret_cast<std::uintptr_t>(cache_->base());
    region_.size = layout.total_bytes();
    region_.layout = layout;
    region_.generation = rma::new_generation();
    // The page epoch table, beside the cache, for readers' epoch checks.
    const PageEpochs& ep = cache_->epochs();
    if (api_->registerLocalMemory(engine_, ep.words(), ep.size_bytes(), options_.location.c_str(),
                                  1) != 0) {
      throw Error(StatusCode::kUnavailable,
                  "Mooncake registerLocalMemory of the page epoch table failed");
    }
    epochs_registered_ = true;
    // The layer readiness words, for streaming readers' bounded polls.
    const PageReadiness& rd = cache_->readiness();
    if (api_->registerLocalMemory(engine_, rd.words(), std::size_t{rd.num_pages()} * 4,
                                  options_.location.c_str(), 1) != 0) {
      throw Error(StatusCode::kUnavailable,
                  "Mooncake registerLocalMemory of the layer readiness words failed");
    }
    ready_registered_ = true;
    region_.backend_blob = encode_blob({reinterpret_cast<std::uintptr_t>(identity_.get()),
                                        reinterpret_cast<std::uintptr_t>(ep.words()),
                                        reinterpret_cast<std::uintptr_t>(rd.words())});
    write_identity(identity_.get(), region_);
    if (api_->registerLocalMemory(engine_, identity_.get(), kIdentityBytes,
                                  options_.location.c_str(), 1) != 0) {
      throw Error(StatusCode::kUnavailable,
                  "Mooncake registerLocalMemory of the identity page failed");
    }
    identity_registered_ = true;
    {
      std::lock_guard<std::mutex> lk(scratch_->mu);
      scratch_->api = api_;
      scratch_->engine = engine_;
      scratch_->log = options_.log;
    }
    progress_ = std::thread([this] { progress_loop(); });
  } catch (...) {
    release_engine();  // no other thread exists yet
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
  // tear-down after the abort grace; with a shared handle only once Mooncake
  // reported every task final).
  if (progress_.joinable()) progress_.join();
  // No batch is in flight now. Scratch pages still held (an idle layer watch,
  // a connect() about to let go of its page) are unregistered by
  // release_engine(), never waited for: their holders' lifetimes are not the
  // engine's.
  std::unique_lock<std::shared_mutex> api(api_mu_);
  release_engine();
}

void MooncakeBackend::release_engine() noexcept {
  if (engine_ == nullptr) return;
  release_scratch();
  // Mooncake's C API is C++ inside: nothing may escape this noexcept path.
  const auto unregister = [&](bool& registered, void* addr, const char* what) noexcept {
    if (!registered) return;
    registered = false;
    try {
      if (api_->unregisterLocalMemory(engine_, addr) != 0) {
        options_.log.error(std::string("mooncake: unregisterLocalMemory of ") + what + " failed");
      }
    } catch (...) {
      options_.log.error(std::string("mooncake: unregisterLocalMemory of ") + what + " threw");
    }
  };
  unregister(cache_registered_, cache_->base(), "the cache");
  unregister(identity_registered_, identity_.get(), "the identity page");
  unregister(epochs_registered_, cache_->epochs().words(), "the page epoch table");
  unregister(ready_registered_, cache_->readiness().words(), "the layer readiness words");
  // A shared handle is the application's: it stays alive and usable.
  if (!shared_) {
    try {
      api_->destroyTransferEngine(engine_);
    } catch (...) {
      options_.log.error("mooncake: destroyTransferEngine threw");
    }
  }
  engine_ = nullptr;
}

Error MooncakeBackend::refusal() const {
  std::lock_guard<std::mutex> lk(mu_);
  return refusal_locked();
}

Error MooncakeBackend::refusal_locked() const {
  if (dead_reason_.empty()) {
    return Error(StatusCode::kShutdown, "the Mooncake backend is shut down");
  }
  if (shared_) {
    return Error(StatusCode::kUnavailable,
                 "the Mooncake engine stopped taking reads (" + dead_reason_ +
                     "); the shared Mooncake engine handle was not destroyed: shut this "
                     "engine down once the hung reads ended, and create a new one");
  }
  return Error(StatusCode::kUnavailable,
               "the Mooncake engine was torn down (" + dead_reason_ + "); create a new engine");
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
    // Checked under mu_: go_dead() sets the reason (and, with its own
    // engine, empties batches_ for the last time) under it, and nothing
    // polls a batch queued after that.
    if (!dead_reason_.empty() || stopping_) throw refusal_locked();
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
    int rc = 0;
    try {
      rc = api_->getTransferStatus(engine_, b.id, b.next, &st);
    } catch (...) {
      // The task's state is unknown: it stays in flight, and the batch is
      // aborted, so that the abort grace (and the tear-down) bound it.
      if (b.error.is_ok()) {
        b.error = Status(StatusCode::kInternal, "Mooncake getTransferStatus threw");
      }
      b.stop_submitting = true;
      b.abort_requested.store(true, std::memory_order_release);
      break;
    }
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
    try {
      b.id = api_->allocateBatchID(engine_, b.req.size());
    } catch (...) {
      b.id = kInvalidBatch;
    }
    if (b.id == kInvalidBatch) {
      b.error = Status(StatusCode::kInternal,
                       "Mooncake allocateBatchID(" + std::to_string(b.req.size()) + ") failed");
      b.stop_submitting = true;
      return true;
    }
  }
  if (outstanding >= window_) return false;
  const std::size_t n = std::min(window_ - outstanding, b.req.size() - b.submitted);
  int rc = 0;
  try {
    rc = api_->submitTransfer(engine_, b.id, b.req.data() + b.submitted, n);
  } catch (...) {
    rc = -1;  // as a refused submit: the tasks it never took answer out of range
  }
  if (rc != 0) {
    b.error =
        Status(map_code(rc), "Mooncake submitTransfer of " + std::to_string(n) + " reads from " +
                                 b.peer_name + " returned " + status_code_name(rc));
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
      internal::UniqueLock lk(mu_);
      cv_.wait(lk, [this] {
        MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
        return !batches_.empty() || stopping_;
      });
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
            b->error =
                Status(StatusCode::kCancelled,
                       "aborted with " + std::to_string(b->req.size() - b->submitted) + " of " +
                           std::to_string(b->req.size()) + " requests not submitted");
          }
        }
        moved |= submit_more(*b, out);
        const bool all_in = b->stop_submitting || b->submitted == b->req.size();
        if (all_in && b->next == b->submitted) {
          if (b->id != kInvalidBatch) {
            int rc = 0;
            try {
              rc = api_->freeBatchID(engine_, b->id);
            } catch (...) {
              rc = -1;
            }
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
              hung.empty() && !dead()) {
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
      for (auto& b : finished) complete(*b, b->error);
    }
    if (!hung.empty()) {
      go_dead(hung);
      if (!shared_) return;  // Mooncake's engine is gone, every batch failed
    }
    // Pause between rounds so that polling does not take a core from
    // Mooncake's own threads: 20 us while requests finish, else backing off
    // (doubling) to 1 ms; a new batch or shutdown wakes the thread early.
    if (moved || !finished.empty()) idle = 0;
    const auto pause = std::chrono::microseconds(std::min(1000, 20 << std::min(idle, 6)));
    ++idle;
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, pause, [&] {
      MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
      return arrivals_ != seen_arrivals || stopping_;
    });
  }
}

void MooncakeBackend::go_dead(const std::string& why) {
  if (shared_) {
    // Mooncake's engine is the application's: keep polling the hung batches
    // (their completions run once Mooncake reports every task final) and
    // take no new work.
    {
      std::lock_guard<std::mutex> lk(mu_);
      dead_reason_ = why;
    }
    dead_.store(true, std::memory_order_release);
    options_.log.error("mooncake: " + why +
                       "; the Mooncake engine handle is the application's and was not "
                       "destroyed: this engine takes no new reads, and the hung reads resolve "
                       "only once Mooncake reports them finished (shutdown waits for them)");
    return;
  }
  {
    std::unique_lock<std::shared_mutex> api(api_mu_);
    if (engine_ != nullptr) {
      // Closes every connection and stops Mooncake's threads: after this no
      // request of ours can write any more. Registrations go with it.
      {
        std::lock_guard<std::mutex> lk(scratch_->mu);
        scratch_->pages.clear();
        scratch_->engine = nullptr;
      }
      try {
        api_->destroyTransferEngine(engine_);
      } catch (...) {
        options_.log.error("mooncake: destroyTransferEngine threw");
      }
      engine_ = nullptr;
      cache_registered_ = identity_registered_ = epochs_registered_ = ready_registered_ = false;
    }
  }
  std::vector<std::shared_ptr<Batch>> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dead_reason_ = why;
    left.swap(batches_);
  }
  dead_.store(true, std::memory_order_release);
  options_.log.error("mooncake: " + why + "; Mooncake's engine was destroyed");
  for (auto& b : left) {
    b->peer_failed->store(true, std::memory_order_release);
    complete(*b, Status(StatusCode::kPeerFailure, why + "; the Mooncake engine was torn down"));
  }
}

void MooncakeBackend::complete(Batch& b, Status status) noexcept {
  auto done = std::move(b.done);
  try {
    done(std::move(status));
  } catch (...) {
    // A completion must not throw (rma_backend.hpp); the progress thread
    // must survive one that does.
    options_.log.error("mooncake: a read's completion threw");
  }
  b.keepalive.reset();
}

}  // namespace mstar::kv::mooncake
