// Copyright mstar-kv authors.
#include "mooncake_readiness.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>

#include "mstar/kv/epochs.hpp"
#include "mstar/kv/thread_annotations.hpp"

namespace mstar::kv::mooncake {

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kPagesPerChunk = 128;
constexpr auto kPollInterval = std::chrono::microseconds(500);
// Where each phase's words land in the scratch page.
constexpr std::size_t kPhaseOffset[3] = {0, 1024, 2048};  // epochs, words, epochs
static_assert(kPagesPerChunk * 8 <= 1024 && kPhaseOffset[2] + kPagesPerChunk * 8 <= kIdentityBytes);

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
        before_(pages_.size()),
        words_(pages_.size()),
        after_(pages_.size()) {
    scratch_keep_ = backend_.scratch_page(&scratch_);  // throws when stopped or dead
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
    post(0, 0);
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
  // Phase 0 and 2 read the epochs of chunk k's pages, phase 1 their words.
  void post(int phase, std::size_t k) {
    const std::size_t first = k * kPagesPerChunk;
    const std::size_t end = std::min(pages_.size(), first + kPagesPerChunk);
    const std::uint64_t width = phase == 1 ? 4 : 8;
    std::vector<rma::RmaRead> reads;
    reads.reserve(end - first);
    for (std::size_t i = first; i < end; ++i) {
      reads.push_back({std::uint64_t{pages_[i]} * width, kPhaseOffset[phase] + (i - first) * width,
                       width});
    }
    auto self = shared_from_this();
    std::shared_ptr<rma::RmaOperation> op;
    try {
      op = backend_.post(segment_, who_, phase == 1 ? ready_ptr_ : epochs_ptr_, scratch_, reads,
                         [self, phase, k](Status st) { self->on_read(phase, k, std::move(st)); },
                         failed_, scratch_keep_);
    } catch (const Error& e) {
      return end_round(e.status());
    }
    bool abort_now = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      current_ = op;
      abort_now = aborted_;
    }
    if (abort_now) op->abort();
  }

  void on_read(int phase, std::size_t k, Status st) {
    if (!st.is_ok()) {
      return end_round({StatusCode::kPeerFailure,
                        "Mooncake read of the layer readiness of " + who_ +
                            " failed: the owner is gone or no longer serves it: " +
                            st.message()});
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    const std::size_t first = k * kPagesPerChunk;
    const std::size_t n = std::min(pages_.size(), first + kPagesPerChunk) - first;
    const std::byte* src = scratch_ + kPhaseOffset[phase];
    if (phase == 0) std::memcpy(before_.data() + first, src, n * 8);
    if (phase == 1) std::memcpy(words_.data() + first, src, n * 4);
    if (phase == 2) std::memcpy(after_.data() + first, src, n * 8);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (aborted_) {
        in_flight_ = false;
        current_.reset();
        return;
      }
    }
    if (phase < 2) return post(phase + 1, k);
    if (first + n < pages_.size()) return post(0, k + 1);
    end_round(evaluate());
  }

  // The checks of check_layer_readiness over this round's snapshots.
  Status evaluate() {
    std::uint32_t floor = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      floor = floor_;
    }
    std::uint32_t lowest = std::numeric_limits<std::uint32_t>::max();
    for (std::size_t i = 0; i < pages_.size(); ++i) {
      if (before_[i] != epoch_) {
        return stale_page_status(pages_[i], before_[i], epoch_, "before its readiness was read");
      }
      if (words_[i] > num_layers_) {
        return {StatusCode::kCorruptDescriptor,
                "remote page " + std::to_string(pages_[i]) + " says " +
                    std::to_string(words_[i]) + " layers are ready, beyond the layout's " +
                    std::to_string(num_layers_) + " layers"};
      }
      if (words_[i] < floor) {
        return {StatusCode::kCorruptDescriptor,
                "remote page " + std::to_string(pages_[i]) + " readiness went backwards: " +
                    std::to_string(words_[i]) + " layers ready, " + std::to_string(floor) +
                    " were ready before"};
      }
      if (after_[i] != epoch_) {
        return stale_page_status(pages_[i], after_[i], epoch_, "while its readiness was read");
      }
      lowest = std::min(lowest, words_[i]);
    }
    std::lock_guard<std::mutex> lk(mu_);
    floor_ = pages_.empty() ? num_layers_ : lowest;
    return Status::ok();
  }

  void end_round(Status st) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!st.is_ok() && error_.is_ok()) error_ = std::move(st);
    in_flight_ = false;
    current_.reset();
  }

  MooncakeBackend& backend_;
  const McSegmentId segment_;
  const std::string who_;
  const std::uint64_t epochs_ptr_;
  const std::uint64_t ready_ptr_;
  const std::shared_ptr<std::atomic<bool>> failed_;
  const std::vector<std::uint32_t> pages_;
  const std::uint64_t epoch_;
  const std::uint32_t num_layers_;
  // One round at a time writes these (the completion of the last read).
  std::vector<std::uint64_t> before_;
  std::vector<std::uint32_t> words_;
  std::vector<std::uint64_t> after_;
  std::shared_ptr<void> scratch_keep_;
  std::byte* scratch_ = nullptr;
  std::mutex mu_;
  Status error_ MSTAR_KV_GUARDED_BY(mu_);
  std::uint32_t floor_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  bool in_flight_ MSTAR_KV_GUARDED_BY(mu_) = false;
  bool aborted_ MSTAR_KV_GUARDED_BY(mu_) = false;
  Clock::time_point next_ MSTAR_KV_GUARDED_BY(mu_){};
  std::shared_ptr<rma::RmaOperation> current_ MSTAR_KV_GUARDED_BY(mu_);
};

class MooncakeLayerWatch final : public LayerWatch {
 public:
  explicit MooncakeLayerWatch(std::shared_ptr<Poller> p) : poller_(std::move(p)) {}
  ~MooncakeLayerWatch() override { poller_->abort(); }  // a round in flight stops
  Status poll(std::uint32_t* layers_ready) override { return poller_->poll(layers_ready); }

 private:
  std::shared_ptr<Poller> poller_;
};

}  // namespace

std::unique_ptr<LayerWatch> make_layer_watch(MooncakeBackend& backend, McSegmentId segment,
                                             std::string who, std::uint64_t epochs_ptr,
                                             std::uint64_t ready_ptr,
                                             std::shared_ptr<std::atomic<bool>> failed,
                                             std::vector<std::uint32_t> pages,
                                             std::uint64_t epoch, std::uint32_t num_layers) {
  return std::make_unique<MooncakeLayerWatch>(std::make_shared<Poller>(
      backend, segment, std::move(who), epochs_ptr, ready_ptr, std::move(failed),
      std::move(pages), epoch, num_layers));
}

}  // namespace mstar::kv::mooncake
