// Copyright mstar-kv authors.
#include "core/staging.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

namespace mstar::kv::staging {

namespace {

// Host buffers kept for reuse: a read's pipeline takes a few and gives
// them back when it ends, so the next read does not fault fresh pages in
// (a read of 8 MiB in 1 MiB messages ran at half speed allocating its
// buffers anew; bench/results/2026-12-05-ucx-staging.md).
class HostPool {
 public:
  static constexpr std::size_t kKept = 32;
  std::unique_ptr<std::byte[]> take(std::size_t bytes, std::size_t* size) {
    {
      std::lock_guard lk(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second >= bytes && (best == free_.end() || it->second < best->second)) best = it;
      }
      if (best != free_.end()) {
        *size = best->second;
        auto block = std::move(best->first);
        free_.erase(best);
        return block;
      }
    }
    *size = bytes;
    return std::unique_ptr<std::byte[]>(new std::byte[bytes]);  // not zero-filled
  }
  void give(std::unique_ptr<std::byte[]> block, std::size_t size) {
    std::lock_guard lk(mu_);
    if (free_.size() < kKept) free_.emplace_back(std::move(block), size);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::unique_ptr<std::byte[]>, std::size_t>> free_;
};

// Every byte is written before it is read: not zero-filled.
class HostBuffer final : public Buffer {
 public:
  HostBuffer(std::shared_ptr<HostPool> pool, std::size_t bytes) : pool_(std::move(pool)) {
    bytes_ = pool_->take(std::max<std::size_t>(bytes, 1), &size_);
  }
  ~HostBuffer() override { pool_->give(std::move(bytes_), size_); }
  std::byte* data() const noexcept override { return bytes_.get(); }
  std::size_t size() const noexcept override { return size_; }

 private:
  std::shared_ptr<HostPool> pool_;
  std::size_t size_ = 0;
  std::unique_ptr<std::byte[]> bytes_;
};

class DoneJob final : public Job {
 public:
  std::optional<Status> poll() override { return Status::ok(); }
  Status wait() override { return Status::ok(); }
};

class HostCopier final : public Copier {
 public:
  std::unique_ptr<Buffer> allocate(std::size_t bytes) override {
    return std::make_unique<HostBuffer>(pool_, bytes);
  }
  std::unique_ptr<Job> gather(const RegionMap& cache, std::span<const StridedSpan> spans,
                              Buffer& into) override {
    std::byte* out = into.data();
    for (const StridedSpan& s : spans) {
      const std::byte* from = cache.pointer(s.remote_offset);  // a span is in one region
      for (std::uint64_t r = 0; r < s.rows; ++r, out += s.length) {
        std::memcpy(out, from + r * s.remote_stride, s.length);
      }
    }
    return std::make_unique<DoneJob>();
  }
  std::unique_ptr<Job> scatter(const Buffer& from, std::span<const StridedSpan> spans,
                               const RegionMap& cache) override {
    const std::byte* in = from.data();
    for (const StridedSpan& s : spans) {
      std::byte* to = cache.pointer(s.local_offset);
      for (std::uint64_t r = 0; r < s.rows; ++r, in += s.length) {
        std::memcpy(to + r * s.local_stride, in, s.length);
      }
    }
    return std::make_unique<DoneJob>();
  }

 private:
  std::shared_ptr<HostPool> pool_ = std::make_shared<HostPool>();
};

std::uint64_t largest(const std::vector<Message>& messages) {
  std::uint64_t m = 1;
  for (const Message& x : messages) m = std::max(m, x.bytes);
  return m;
}

void check_messages(std::span<const StridedSpan> spans, const std::vector<Message>& messages,
                    std::size_t buffers) {
  if (buffers == 0) throw Error(StatusCode::kInvalidArgument, "staging needs at least one buffer");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const Message& m = messages[i];
    std::uint64_t bytes = 0;
    const bool in = m.count > 0 && m.first < spans.size() && m.count <= spans.size() - m.first;
    for (std::size_t k = 0; in && k < m.count; ++k) bytes += spans[m.first + k].bytes();
    if (!in || bytes != m.bytes) {
      throw Error(StatusCode::kInvalidArgument,
                  "staging message " + std::to_string(i) + " (spans " + std::to_string(m.first) +
                      "+" + std::to_string(m.count) + ", " + std::to_string(m.bytes) +
                      " bytes) does not match the read's " + std::to_string(spans.size()) +
                      " spans");
    }
  }
}

}  // namespace

std::shared_ptr<Copier> host_copier() { return std::make_shared<HostCopier>(); }

std::vector<Message> split_messages(std::span<const StridedSpan> spans, std::uint64_t max_bytes,
                                    std::size_t max_spans) {
  std::vector<Message> out;
  for (std::size_t i = 0; i < spans.size();) {
    Message m{i, 0, 0};
    while (i < spans.size() &&
           (m.count == 0 || (m.bytes + spans[i].bytes() <= max_bytes && m.count < max_spans))) {
      m.bytes += spans[i].bytes();
      ++m.count;
      ++i;
    }
    out.push_back(m);
  }
  return out;
}

// ---- the owner's side -----------------------------------------------------------

GatherPipeline::GatherPipeline(std::shared_ptr<Copier> copier, RegionMap cache,
                               std::vector<StridedSpan> spans, std::vector<Message> messages,
                               std::size_t buffers)
    : copier_(std::move(copier)),
      cache_(std::move(cache)),
      spans_(std::move(spans)),
      messages_(std::move(messages)) {
  check_messages(spans_, messages_, buffers);
  const std::uint64_t size = largest(messages_);
  slots_.resize(std::min(buffers, std::max<std::size_t>(messages_.size(), 1)));
  for (Slot& s : slots_) s.buffer = copier_->allocate(size);
}

GatherPipeline::~GatherPipeline() {
  for (Slot& s : slots_) {
    if (s.state == Slot::kGathering) (void)s.job->wait();
  }
}

std::optional<GatherPipeline::Ready> GatherPipeline::poll() {
  for (Slot& s : slots_) {
    if (s.state != Slot::kGathering) continue;
    const std::optional<Status> done = s.job->poll();
    if (!done) continue;
    --running_;
    s.job.reset();
    if (!done->is_ok()) {
      if (status_.is_ok()) status_ = *done;
      aborted_ = true;
      s.state = Slot::kFree;
    } else {
      s.state = Slot::kGathered;
    }
  }
  // Gathers into free buffers, in message order.
  while (!aborted_ && next_gather_ < messages_.size()) {
    Slot* free = nullptr;
    for (Slot& s : slots_) {
      if (s.state == Slot::kFree) {
        free = &s;
        break;
      }
    }
    if (free == nullptr) break;
    const Message& m = messages_[next_gather_];
    try {
      free->job =
          copier_->gather(cache_, std::span(spans_).subspan(m.first, m.count), *free->buffer);
    } catch (const Error& e) {
      status_ = e.status();
      aborted_ = true;
      break;
    }
    free->message = next_gather_++;
    free->state = Slot::kGathering;
    ++running_;
  }
  if (aborted_) return std::nullopt;
  // The next message in order, once gathered.
  for (Slot& s : slots_) {
    if (s.state == Slot::kGathered && s.message == next_send_) {
      s.state = Slot::kSending;
      ++next_send_;
      return Ready{s.message, s.buffer->data(), messages_[s.message].bytes};
    }
  }
  return std::nullopt;
}

void GatherPipeline::sent(std::size_t index) {
  for (Slot& s : slots_) {
    if (s.state == Slot::kSending && s.message == index) {
      s.state = Slot::kFree;
      ++sent_count_;
      return;
    }
  }
}

// ---- the reader's side ----------------------------------------------------------

ScatterPipeline::ScatterPipeline(std::shared_ptr<Copier> copier, RegionMap cache,
                                 std::vector<StridedSpan> spans, std::vector<Message> messages,
                                 std::size_t buffers)
    : copier_(std::move(copier)),
      cache_(std::move(cache)),
      spans_(std::move(spans)),
      messages_(std::move(messages)),
      seen_(messages_.size(), 0) {
  check_messages(spans_, messages_, buffers);
  const std::uint64_t size = largest(messages_);
  slots_.resize(std::min(buffers, std::max<std::size_t>(messages_.size(), 1)));
  for (Slot& s : slots_) s.buffer = copier_->allocate(size);
}

ScatterPipeline::~ScatterPipeline() {
  for (Slot& s : slots_) {
    if (s.state == Slot::kScattering) (void)s.job->wait();
  }
}

void ScatterPipeline::fail(Status why) {
  if (status_.is_ok()) status_ = std::move(why);
  aborted_ = true;
}

Buffer* ScatterPipeline::receive_into(std::size_t index) {
  if (aborted_) return nullptr;
  if (index >= messages_.size() || seen_[index] != 0) {
    fail(Status(StatusCode::kInternal,
                "staged message " + std::to_string(index) + " of " +
                    std::to_string(messages_.size()) +
                    (index < messages_.size() ? " arrived twice" : " is not part of the read")));
    return nullptr;
  }
  for (Slot& s : slots_) {
    if (s.state == Slot::kFree) {
      seen_[index] = 1;
      s.state = Slot::kReceiving;
      s.message = index;
      return s.buffer.get();
    }
  }
  return nullptr;
}

void ScatterPipeline::received(std::size_t index) {
  for (Slot& s : slots_) {
    if (s.state != Slot::kReceiving || s.message != index) continue;
    if (aborted_) {
      s.state = Slot::kFree;
      return;
    }
    const Message& m = messages_[index];
    try {
      s.job = copier_->scatter(*s.buffer, std::span(spans_).subspan(m.first, m.count), cache_);
    } catch (const Error& e) {
      s.state = Slot::kFree;
      fail(e.status());
      return;
    }
    s.state = Slot::kScattering;
    ++running_;
    return;
  }
  fail(Status(StatusCode::kInternal,
              "staged message " + std::to_string(index) + " completed without a buffer"));
}

void ScatterPipeline::lost(std::size_t index, const Status& why) {
  for (Slot& s : slots_) {
    if (s.state == Slot::kReceiving && s.message == index) s.state = Slot::kFree;
  }
  fail(why);
}

void ScatterPipeline::poll() {
  for (Slot& s : slots_) {
    if (s.state != Slot::kScattering) continue;
    const std::optional<Status> done = s.job->poll();
    if (!done) continue;
    --running_;
    s.job.reset();
    s.state = Slot::kFree;
    if (!done->is_ok()) {
      fail(*done);
    } else {
      ++scattered_;
    }
  }
}

}  // namespace mstar::kv::staging
