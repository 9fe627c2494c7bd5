// Copyright mstar-kv authors.
//
// InProcessRmaBackend: an RMA backend (engines/rma/rma_backend.hpp) over the
// caches of this process, for testing RmaKVTransferEngine and the stream
// driver apart from any transport (as tests/reliability/inproc_engine.hpp
// does for the fault wrapper). Each backend serves its cache under a session
// id in a process-wide directory; a peer's reads copy real bytes from the
// owner's cache on the reading backend's worker thread, between two checks
// of the owner's page epochs (RmaEpochCheck); its layer watch reads the
// owner's readiness words with check_layer_readiness. With `hold`, every
// batch stays in flight until it is aborted (a peer that hangs).
//
// It counts the RmaOperation and LayerWatch objects alive (shared counters,
// which outlive the backend) and records how many were alive when its
// shutdown() had completed every batch: a backend may hold resources for
// them (Mooncake's scratch pages), so the engine must not keep them then.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "rma/rma_backend.hpp"
#include "rma/rma_engine.hpp"

namespace mstar::kv::testing {

struct RmaLiveCounts {
  std::atomic<int> operations{0};
  std::atomic<int> watches{0};
  // At the end of shutdown(), once every batch had completed; -1 before.
  std::atomic<int> operations_at_shutdown{-1};
  std::atomic<int> watches_at_shutdown{-1};
};

class InProcessRmaBackend final : public rma::RmaBackend {
 public:
  static constexpr const char* kName = "inproc_rma";

  InProcessRmaBackend(std::shared_ptr<KVCache> cache, std::string session_id, bool hold = false)
      : cache_(std::move(cache)), hold_(hold), state_(std::make_shared<State>()) {
    region_.entity_id = session_id;
    region_.session_id = session_id;
    region_.data_ptr = reinterpret_cast<std::uintptr_t>(cache_->base());
    region_.size = cache_->size_bytes();
    region_.layout = cache_->layout();
    region_.generation = rma::new_generation();
    std::lock_guard<std::mutex> lk(directory_mu());
    directory()[session_id] = this;
    worker_ = std::thread([this] { run(); });
  }
  ~InProcessRmaBackend() override {
    shutdown();
    std::lock_guard<std::mutex> lk(directory_mu());
    directory().erase(region_.session_id);
  }

  std::shared_ptr<RmaLiveCounts> counts() const { return counts_; }

  std::string_view engine_name() const noexcept override { return kName; }
  rma::RmaRegionInfo local_region() const override { return region_; }

  std::shared_ptr<rma::RmaPeer> connect(const rma::RmaRegionInfo& remote,
                                        std::chrono::milliseconds) override {
    std::lock_guard<std::mutex> lk(directory_mu());
    auto it = directory().find(remote.session_id);
    if (it == directory().end()) {
      throw Error(StatusCode::kPeerFailure, "no in-process owner at '" + remote.session_id + "'");
    }
    return std::make_shared<Peer>(*this, it->second->cache_, it->second->region_);
  }

  void shutdown() noexcept override {
    {
      std::lock_guard<std::mutex> lk(state_->mu);
      if (state_->stopping) return;
      state_->stopping = true;
    }
    state_->cv.notify_all();
    if (worker_.joinable()) worker_.join();
    counts_->operations_at_shutdown = counts_->operations.load();
    counts_->watches_at_shutdown = counts_->watches.load();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool stopping = false;
  };

  struct Batch final : rma::RmaOperation {
    Batch(std::shared_ptr<State> s, std::shared_ptr<RmaLiveCounts> c)
        : state(std::move(s)), counts(std::move(c)) {
      ++counts->operations;
    }
    ~Batch() override { --counts->operations; }
    void abort() noexcept override {
      {
        std::lock_guard<std::mutex> lk(state->mu);
        aborted = true;
      }
      state->cv.notify_all();
    }
    std::shared_ptr<State> state;
    std::shared_ptr<RmaLiveCounts> counts;
    std::shared_ptr<KVCache> owner;
    std::vector<rma::RmaRead> reads;
    rma::RmaCompletion done;
    rma::RmaEpochCheck check;
    bool aborted = false;  // guarded by state->mu
  };

  class Watch final : public LayerWatch {
   public:
    Watch(std::shared_ptr<KVCache> owner, std::vector<std::uint32_t> pages, std::uint64_t epoch,
          std::uint32_t num_layers, std::shared_ptr<RmaLiveCounts> counts)
        : owner_(std::move(owner)),
          pages_(std::move(pages)),
          epoch_(epoch),
          num_layers_(num_layers),
          counts_(std::move(counts)) {
      ++counts_->watches;
    }
    ~Watch() override { --counts_->watches; }
    Status poll(std::uint32_t* layers_ready) override {
      const Status s = check_layer_readiness(owner_->readiness().words(), owner_->epochs().words(),
                                             owner_->layout().num_pages, pages_, epoch_,
                                             num_layers_, floor_, layers_ready);
      if (s.is_ok()) floor_ = *layers_ready;
      return s;
    }

   private:
    std::shared_ptr<KVCache> owner_;
    std::vector<std::uint32_t> pages_;
    std::uint64_t epoch_;
    std::uint32_t num_layers_;
    std::uint32_t floor_ = 0;
    std::shared_ptr<RmaLiveCounts> counts_;
  };

  class Peer final : public rma::RmaPeer {
   public:
    Peer(InProcessRmaBackend& reader, std::shared_ptr<KVCache> owner, rma::RmaRegionInfo served)
        : reader_(reader), owner_(std::move(owner)), served_(std::move(served)) {}
    void verify(const rma::RmaRegionInfo& claimed) const override {
      rma::verify_region(served_, claimed);
    }
    bool failed() const noexcept override { return false; }
    std::shared_ptr<rma::RmaOperation> post_reads(std::vector<rma::RmaRead> reads,
                                                  rma::RmaCompletion done,
                                                  rma::RmaEpochCheck check) override {
      auto b = std::make_shared<Batch>(reader_.state_, reader_.counts_);
      b->owner = owner_;
      b->reads = std::move(reads);
      b->done = std::move(done);
      b->check = std::move(check);
      reader_.enqueue(b);
      return b;
    }
    std::unique_ptr<LayerWatch> watch_layers(std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                             std::uint32_t num_layers) override {
      return std::make_unique<Watch>(owner_, std::move(pages), epoch, num_layers, reader_.counts_);
    }

   private:
    InProcessRmaBackend& reader_;
    std::shared_ptr<KVCache> owner_;
    rma::RmaRegionInfo served_;
  };

  void enqueue(std::shared_ptr<Batch> b) {
    {
      std::lock_guard<std::mutex> lk(state_->mu);
      if (state_->stopping) throw Error(StatusCode::kShutdown, "the in-process backend stopped");
      queue_.push_back(std::move(b));
    }
    state_->cv.notify_all();
  }

  static Status epochs_of(const Batch& b, const char* when, bool after_copy) {
    if (b.check.epoch == 0) return Status::ok();
    return check_page_epochs(b.owner->epochs().words(), b.owner->layout().num_pages, b.check.pages,
                             b.check.epoch, when, after_copy);
  }

  // Copies each batch in turn; with hold_, a batch waits for its abort (or
  // shutdown). Every batch completes exactly once, here.
  void run() {
    for (;;) {
      std::shared_ptr<Batch> b;
      {
        std::unique_lock<std::mutex> lk(state_->mu);
        state_->cv.wait(lk, [&] { return state_->stopping || !queue_.empty(); });
        if (queue_.empty()) return;
        b = queue_.front();
        if (hold_) {
          state_->cv.wait(lk, [&] { return state_->stopping || b->aborted; });
        }
        queue_.pop_front();
      }
      Status st = Status::ok();
      bool aborted = false;
      {
        std::lock_guard<std::mutex> lk(state_->mu);
        aborted = b->aborted || state_->stopping;
      }
      if (aborted) {
        st = Status(StatusCode::kCancelled, "aborted before any byte moved");
      } else if (st = epochs_of(*b, "before the copy", false); st.is_ok()) {
        for (const auto& r : b->reads) {
          std::memcpy(cache_->base() + r.local_offset, b->owner->base() + r.remote_offset,
                      r.length);
        }
        st = epochs_of(*b, "after the copy", true);
      }
      auto done = std::move(b->done);
      b.reset();  // the engine's handles are all that may keep it now
      done(st);
    }
  }

  static std::mutex& directory_mu() {
    static std::mutex mu;
    return mu;
  }
  static std::map<std::string, InProcessRmaBackend*>& directory() {
    static std::map<std::string, InProcessRmaBackend*> d;
    return d;
  }

  std::shared_ptr<KVCache> cache_;
  const bool hold_;
  rma::RmaRegionInfo region_;
  std::shared_ptr<State> state_;
  std::shared_ptr<RmaLiveCounts> counts_ = std::make_shared<RmaLiveCounts>();
  std::deque<std::shared_ptr<Batch>> queue_;  // guarded by state_->mu
  std::thread worker_;
};

}  // namespace mstar::kv::testing
