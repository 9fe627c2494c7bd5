// Copyright mstar-kv authors.
//
// Staging: a remote engine serves and fills a cache its
// transport cannot touch (GPU memory, with a UCX or Mooncake built without
// CUDA) through host buffers it can: the owner gathers the spans a message
// carries from its cache into a buffer and sends the buffer; the reader
// receives a message into a buffer and scatters it into its cache. With two
// (or more) buffers per side the copies of one message overlap the wire
// time of the next.
//
// The copies are a Copier's: memcpy of every row for host memory
// (host_copier(): the tests, and host caches forced through staging), the
// copy kernel for device memory (the cuda_ipc engine's DeviceCopier, over
// span tables with Packing::kDestination to gather, kSource to scatter).
// The pipelines below hold the buffer management, the order and the
// failure rules, whatever the copier and whatever the transport: they never
// block, the transport's progress loop calls poll().
//
// A message is a run of whole strided spans (planner.hpp) of one read, in
// the read's order; its bytes are the spans' rows back to back, the remote
// side's on the wire (the owner's view) and the local side's once scattered.
// Not thread-safe: one pipeline belongs to one progress thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::staging {

// Host memory a copier gathers into and scatters from (pinned for a
// device). Owned by its pipeline.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual std::byte* data() const noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
};

// One copy in flight. The bytes it writes land only before it reports
// done: after poll() returned a value (or wait() returned), it writes none.
class Job {
 public:
  virtual ~Job() = default;
  // Non-blocking: nullopt while it runs, then its outcome (ok, or why it
  // failed), the same on every later call.
  virtual std::optional<Status> poll() = 0;
  // Blocks until it finished; its outcome.
  virtual Status wait() = 0;
};

// Moves bytes between a cache's memory and Buffers. Thread safety: any
// thread (a copier may be shared by the pipelines of many reads).
class Copier {
 public:
  virtual ~Copier() = default;
  // A buffer of at least `bytes`. Throws Error (kInternal, naming the
  // allocation that failed).
  virtual std::unique_ptr<Buffer> allocate(std::size_t bytes) = 0;
  // Starts copying the remote side's rows of `spans` (remote_offset and
  // remote_stride, layout offsets of `cache`: regions.hpp) into `into`,
  // back to back. The spans and buffer must outlive the job. Throws Error
  // only when nothing started.
  virtual std::unique_ptr<Job> gather(const RegionMap& cache, std::span<const StridedSpan> spans,
                                      Buffer& into) = 0;
  // Starts copying `from` (the spans' rows back to back) into the local
  // side of `spans` (local_offset and local_stride, layout offsets of `cache`).
  virtual std::unique_ptr<Job> scatter(const Buffer& from, std::span<const StridedSpan> spans,
                                       const RegionMap& cache) = 0;
};

// memcpy on the calling thread: every job is done when it is returned. Its
// buffers are kept for reuse when freed (up to 32), as a device copier keeps
// its pinned ones.
std::shared_ptr<Copier> host_copier();

// Splits `spans` into messages of whole spans of at most max_bytes (a span
// larger than that is a message alone) and at most max_spans spans.
struct Message {
  std::size_t first = 0;  // index of its first span
  std::size_t count = 0;  // spans
  std::uint64_t bytes = 0;
};
std::vector<Message> split_messages(std::span<const StridedSpan> spans, std::uint64_t max_bytes,
                                    std::size_t max_spans);

// The owner's side of one read: gathers message after message into up to
// `buffers` buffers (each of the largest message's size, allocated once),
// hands each gathered message to the transport in order (ready()), and
// reuses its buffer once the transport says it was sent.
class GatherPipeline {
 public:
  // Throws Error when a buffer cannot be allocated or `buffers` is 0.
  GatherPipeline(std::shared_ptr<Copier> copier, RegionMap cache, std::vector<StridedSpan> spans,
                 std::vector<Message> messages, std::size_t buffers = 2);
  ~GatherPipeline();  // waits for gathers still running
  GatherPipeline(const GatherPipeline&) = delete;
  GatherPipeline& operator=(const GatherPipeline&) = delete;

  struct Ready {
    std::size_t index = 0;  // the message
    const std::byte* data = nullptr;
    std::uint64_t bytes = 0;
  };
  // Progress: collects finished gathers, starts gathers into free buffers,
  // and returns the next message to send (in message order), or nullopt.
  // Its buffer stays the transport's until sent(index).
  std::optional<Ready> poll();
  // The transport is done with message `index` (sent, or given up): its
  // buffer gathers the next message.
  void sent(std::size_t index);
  // Stops: no gather starts any more; poll() only collects.
  void abort() noexcept { aborted_ = true; }
  // No gather running (after abort(): nothing more reads the cache).
  bool idle() const noexcept { return running_ == 0; }
  // Every message was handed over and sent.
  bool finished() const noexcept { return sent_count_ == messages_.size(); }
  // A gather's failure (the read fails with it), else ok.
  const Status& status() const noexcept { return status_; }
  std::size_t messages() const noexcept { return messages_.size(); }

 private:
  struct Slot {
    std::unique_ptr<Buffer> buffer;
    std::unique_ptr<Job> job;
    std::size_t message = 0;
    enum { kFree, kGathering, kGathered, kSending } state = kFree;
  };
  std::shared_ptr<Copier> copier_;
  RegionMap cache_;
  std::vector<StridedSpan> spans_;
  std::vector<Message> messages_;
  std::vector<Slot> slots_;
  std::size_t next_gather_ = 0;  // the next message to gather
  std::size_t next_send_ = 0;    // the next message to hand over
  std::size_t sent_count_ = 0;
  std::size_t running_ = 0;
  bool aborted_ = false;
  Status status_;
};

// The reader's side of one read: a buffer per message received (up to
// `buffers` at once; a message that finds none waits, see receive_into),
// a scatter once its bytes are in, the buffer reused once the scatter is
// done. Messages may arrive in any order, each once.
class ScatterPipeline {
 public:
  // Throws Error when a buffer cannot be allocated or `buffers` is 0.
  ScatterPipeline(std::shared_ptr<Copier> copier, RegionMap cache, std::vector<StridedSpan> spans,
                  std::vector<Message> messages, std::size_t buffers = 2);
  ~ScatterPipeline();  // waits for scatters still running
  ScatterPipeline(const ScatterPipeline&) = delete;
  ScatterPipeline& operator=(const ScatterPipeline&) = delete;

  // A buffer to receive message `index` into (at least its bytes), or
  // nullptr while every buffer is busy (poll() frees them). Fails the
  // pipeline (status(), nullptr) for an index out of range or given twice.
  Buffer* receive_into(std::size_t index);
  // Message `index`'s bytes are in its buffer: its scatter starts.
  void received(std::size_t index);
  // Message `index` will not arrive in its buffer (a failed receive): the
  // buffer is free again; the pipeline fails with `why`.
  void lost(std::size_t index, const Status& why);
  // Progress: collects finished scatters, freeing their buffers.
  void poll();
  void abort() noexcept { aborted_ = true; }
  // No scatter running (after abort(): nothing more writes the cache).
  bool idle() const noexcept { return running_ == 0; }
  // Every message was scattered.
  bool finished() const noexcept { return scattered_ == messages_.size(); }
  const Status& status() const noexcept { return status_; }
  std::size_t messages() const noexcept { return messages_.size(); }
  const Message& message(std::size_t index) const { return messages_.at(index); }

 private:
  struct Slot {
    std::unique_ptr<Buffer> buffer;
    std::unique_ptr<Job> job;
    std::size_t message = 0;
    enum { kFree, kReceiving, kScattering } state = kFree;
  };
  void fail(Status why);
  std::shared_ptr<Copier> copier_;
  RegionMap cache_;
  std::vector<StridedSpan> spans_;
  std::vector<Message> messages_;
  std::vector<std::uint8_t> seen_;
  std::vector<Slot> slots_;
  std::size_t scattered_ = 0;
  std::size_t running_ = 0;
  bool aborted_ = false;
  Status status_;
};

}  // namespace mstar::kv::staging
