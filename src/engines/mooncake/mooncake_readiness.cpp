// Copyright mstar-kv authors.
#include "mooncake_readiness.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <utility>

#include "mooncake_words.hpp"
#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv::mooncake {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollInterval = std::chrono::microseconds(500);

class Poller : public std::enable_shared_from_this<Poller> {
 public:
  Poller(MooncakeBackend& backend, McSegmentId segment, std::string who, std::uint64_t epochs_ptr,
         std::uint64_t ready_ptr, std::shared_ptr<std::atomic<bool>> failed,
         std::vector<std::uint32_t> pages, std::uint64_t epoch, std::uint32_t num_layers)
      : backend_(backend),
        segment_(segment),
        who_(std::move(who)),
        epochs_ptr_(epochs_ptr),
        ready_ptr_(ready_ptr),
        failed_(std::move(failed)),
        pages_(std::move(pages)),
        epoch_(epoch),
        num_layers_(num_layers),
        reads_(watch_reads(pages_)) {
    scratch_keep_ = backend_.scratch(reads_.bytes, &scratch_);  // throws when stopped or dead
  }

  Status poll(std::uint32_t* layers_ready) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_.is_ok()) return error_;
      *layers_ready = floor_;
      const auto now = Clock::now();
      if (in_flight_ || now < next_) return Status::ok();
      in_flight_ = true;
      next_ = now + kPollInterval;
    }
    post(0);
    return Status::ok();
  }

  void abort() noexcept {
    std::shared_ptr<rma::RmaOperation> op;
    {
      std::lock_guard<std::mutex> lk(mu_);
      aborted_ = true;
      op = current_;
    }
    if (op) op->abort();
  }

 private:
  // Phase 0 and 2 read the epochs of the pages, phase 1 their readiness
  // words, each in runs (mooncake_words.hpp) into its part of the scratch
  // memory; one phase after the other (the seqlock's order).
  void post(int phase) {
    auto self = shared_from_this();
    std::shared_ptr<rma::RmaOperation> op;
    try {
      op = backend_.post(
          segment_, who_, phase == 1 ? ready_ptr_ : epochs_ptr_, scratch_,
          reads_.phase[phase].reads,
          [self, phase](Status st) { self->on_read(phase, std::move(st)); }, failed_,
          scratch_keep_);
    } catch (const Error& e) {
      return end_round(e.status());
    } catch (const std::exception& e) {
      return end_round(Status(StatusCode::kInternal, e.what()));
    }
    bool abort_now = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      current_ = op;
      abort_now = aborted_;
    }
    if (abort_now) op->abort();
  }

  void on_read(int phase, Status st) {
    if (!st.is_ok()) {
      return end_round({StatusCode::kPeerFailure,
                        "Mooncake read of the layer readiness of " + who_ +
                            " failed: the owner is gone or no longer serves it: " + st.message()});
    }
    // Each phase lands in its own part of the scratch memory; the round's
    // check reads all three after the last.
    std::atomic_thread_fence(std::memory_order_acquire);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) {
        in_flight_ = false;
        current_.reset();
        return;
      }
    }
    if (phase < 2) return post(phase + 1);
    end_round(evaluate());
  }

  // The checks of check_layer_readiness over this round's words
  // (mooncake_words.hpp: the same checks as the wheel engine's).
  Status evaluate() {
    std::uint32_t floor = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      floor = floor_;
    }
    std::uint32_t ready = 0;
    Status st = check_watch_words(reads_, pages_, {scratch_, reads_.bytes}, epoch_, num_layers_,
                                  floor, &ready);
    if (!st.is_ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    floor_ = ready;
    return Status::ok();
  }

  void end_round(Status st) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!st.is_ok() && error_.is_ok()) error_ = std::move(st);
      in_flight_ = false;
      current_.reset();
      wake = wake_;
    }
    if (wake) wake();  // the next poll() sees this round (and may start one)
  }

 public:
  void set_wake(std::function<void()> wake) {
    std::lock_guard<std::mutex> lk(mu_);
    wake_ = std::move(wake);
  }

 private:
  MooncakeBackend& backend_;
  const McSegmentId segment_;
  const std::string who_;
  const std::uint64_t epochs_ptr_;
  const std::uint64_t ready_ptr_;
  const std::shared_ptr<std::atomic<bool>> failed_;
  const std::vector<std::uint32_t> pages_;
  const std::uint64_t epoch_;
  const std::uint32_t num_layers_;
  const WatchReads reads_;
  std::shared_ptr<void> scratch_keep_;
  std::byte* scratch_ = nullptr;
  std::mutex mu_;
  Status error_ MSTAR_KV_GUARDED_BY(mu_);
  std::uint32_t floor_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  bool in_flight_ MSTAR_KV_GUARDED_BY(mu_) = false;
  bool aborted_ MSTAR_KV_GUARDED_BY(mu_) = false;
  Clock::time_point next_ MSTAR_KV_GUARDED_BY(mu_){};
  std::shared_ptr<rma::RmaOperation> current_ MSTAR_KV_GUARDED_BY(mu_);
  std::function<void()> wake_ MSTAR_KV_GUARDED_BY(mu_);
};

class MooncakeLayerWatch final : public LayerWatch {
 public:
  explicit MooncakeLayerWatch(std::shared_ptr<Poller> p) : poller_(std::move(p)) {}
  ~MooncakeLayerWatch() override { poller_->abort(); }  // a round in flight stops
  Status poll(std::uint32_t* layers_ready) override { return poller_->poll(layers_ready); }
  // A round's result arrives with its last read: the driver need not poll
  // between rounds, which start at most every kPollInterval.
  std::chrono::microseconds wake_on_news(std::function<void()> wake) override {
    poller_->set_wake(std::move(wake));
    return kPollInterval;
  }

 private:
  std::shared_ptr<Poller> poller_;
};

}  // namespace

std::unique_ptr<LayerWatch> make_layer_watch(MooncakeBackend& backend, McSegmentId segment,
                                             std::string who, std::uint64_t epochs_ptr,
                                             std::uint64_t ready_ptr,
                                             std::shared_ptr<std::atomic<bool>> failed,
                                             std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                             std::uint32_t num_layers) {
  return std::make_unique<MooncakeLayerWatch>(
      std::make_shared<Poller>(backend, segment, std::move(who), epochs_ptr, ready_ptr,
                               std::move(failed), std::move(pages), epoch, num_layers));
}

}  // namespace mstar::kv::mooncake
