// Copyright mstar-kv authors.
//
// InProcessEngine: a small real engine that reads from another KVCache of
// the same process, for testing the fault wrapper in isolation from any
// transport. It validates like every engine (plan_copies before any byte
// moves), copies on its own worker thread span by span (optionally pausing
// between spans, so that tests can catch a read mid-flight), honours cancel
// and its timeout between spans, and resolves only after its last write.
// Safe from any thread; shutdown() resolves everything with kShutdown.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::testing {

class InProcessEngine final : public KVTransferEngine {
 public:
  InProcessEngine(std::shared_ptr<KVCache> local, std::shared_ptr<KVCache> remote,
                  std::chrono::milliseconds pause_per_span = std::chrono::milliseconds(0),
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(5000))
      : local_(std::move(local)),
        remote_(std::move(remote)),
        pause_(pause_per_span),
        timeout_(timeout),
        worker_([this] { run(); }) {}
  ~InProcessEngine() override { shutdown(); }

  KVTransferInfo get_kv_transfer_info() const override { return {"inproc", {}}; }

  RemoteHandle open_remote(const KVTransferInfo& remote_kv_info) const override {
    if (remote_kv_info.engine != "inproc") {
      throw Error(StatusCode::kInvalidArgument,
                  "descriptor for engine '" + remote_kv_info.engine + "', expected 'inproc'");
    }
    return std::make_shared<RemoteCache>(remote_kv_info, remote_->layout());
  }

  std::optional<TransferFuture> read_batched_async(const RemoteCache& /*remote*/,
                                                   std::span<const KVReadInfo> reads) override {
    if (reads.empty()) return std::nullopt;
    Job job;
    job.spans = plan_copies(local_->layout(), remote_->layout(), reads).spans;
    job.deadline = std::chrono::steady_clock::now() + timeout_;
    TransferFuture f = job.promise.future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) throw Error(StatusCode::kShutdown, "InProcessEngine is shut down");
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
    return f;
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_ && !worker_.joinable()) return;
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  std::uint64_t reads_issued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return issued_;
  }

 private:
  struct Job {
    TransferPromise promise;
    std::vector<CopySpan> spans;
    std::chrono::steady_clock::time_point deadline;
  };

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      ++issued_;
      lock.unlock();
      std::uint64_t bytes = 0;
      Status st;
      for (const CopySpan& s : job.spans) {
        {
          std::lock_guard<std::mutex> l(mu_);
          if (stop_) st = {StatusCode::kShutdown, "InProcessEngine shut down mid-read"};
        }
        if (st.is_ok() && job.promise.cancel_requested())
          st = {StatusCode::kCancelled, "cancelled"};
        if (st.is_ok() && std::chrono::steady_clock::now() > job.deadline) {
          st = {StatusCode::kTimeout, "InProcessEngine read timed out"};
        }
        if (!st.is_ok()) break;
        std::memcpy(local_->base() + s.local_offset, remote_->base() + s.remote_offset, s.length);
        bytes += s.length;
        if (pause_.count() > 0) std::this_thread::sleep_for(pause_);
      }
      // Every write of this job is done: resolving now keeps the contract.
      if (st.is_ok()) {
        job.promise.complete(bytes);
      } else {
        job.promise.fail(st);
      }
      lock.lock();
    }
  }

  std::shared_ptr<KVCache> local_;
  std::shared_ptr<KVCache> remote_;
  const std::chrono::milliseconds pause_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;      // guarded by mu_
  bool stop_ = false;         // guarded by mu_
  std::uint64_t issued_ = 0;  // guarded by mu_
  std::thread worker_;
};

}  // namespace mstar::kv::testing
