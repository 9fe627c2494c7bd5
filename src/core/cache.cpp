// Copyright mstar-kv authors.
#include "mstar/kv/cache.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "mstar/kv/status.hpp"

namespace mstar::kv {

namespace {

// Anonymous mmap: page-aligned, zero-filled, returned to the OS on free.
class HostMemory final : public KVMemory {
 public:
  explicit HostMemory(std::size_t size) : size_(size) {
    void* p = ::mmap(nullptr, size_ == 0 ? 1 : size_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(StatusCode::kRetryLater,
                  "cannot allocate " + std::to_string(size_) +
                      " bytes of host memory: " + std::strerror(errno));
    }
    data_ = static_cast<std::byte*>(p);
  }
  ~HostMemory() override { ::munmap(data_, size_ == 0 ? 1 : size_); }
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  std::byte* data() const noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return MemoryKind::kHost; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

void check_index(const char* what, std::uint64_t value, std::uint64_t limit) {
  if (value >= limit) {
    throw Error(StatusCode::kInvalidArgument,
                std::string(what) + " " + std::to_string(value) +
                    " out of range [0, " + std::to_string(limit) + ")");
  }
}

}  // namespace

std::unique_ptr<KVMemory> allocate_host_memory(std::size_t size) {
  return std::make_unique<HostMemory>(size);
}

KVCache::KVCache(const KVLayout& layout, std::unique_ptr<KVMemory> memory)
    : layout_(layout), memory_(std::move(memory)) {
  layout_.validate();
  if (!memory_) {
    throw Error(StatusCode::kInvalidArgument, "KVCache needs memory, got null");
  }
  if (memory_->size() < layout_.total_bytes()) {
    throw Error(StatusCode::kInvalidArgument,
                "KVCache memory of " + std::to_string(memory_->size()) +
                    " bytes is smaller than the layout's " +
                    std::to_string(layout_.total_bytes()) + " bytes");
  }
  // The mirror first: a memory may make its host tables with it (cuda_ipc).
  const EpochMirror* mirror = memory_->epoch_mirror(layout_.num_pages);
  std::uint64_t* words = memory_->epoch_words(layout_.num_pages);
  if (words == nullptr) {
    epoch_memory_ = allocate_host_memory(std::size_t{layout_.num_pages} * 8);
    words = reinterpret_cast<std::uint64_t*>(epoch_memory_->data());
  }
  epochs_ = PageEpochs(words, layout_.num_pages, mirror);
  std::uint32_t* ready = memory_->ready_words(layout_.num_pages);
  if (ready == nullptr) {
    ready_memory_ = allocate_host_memory(std::size_t{layout_.num_pages} * 4);
    ready = reinterpret_cast<std::uint32_t*>(ready_memory_->data());
  }
  readiness_ = PageReadiness(ready, layout_.num_pages);
}

std::shared_ptr<KVCache> KVCache::create_host(const KVLayout& layout) {
  layout.validate();
  return std::make_shared<KVCache>(layout,
                                   allocate_host_memory(layout.total_bytes()));
}

std::span<std::byte> KVCache::block(std::uint32_t layer, KV kv,
                                    std::uint32_t page) const {
  check_index("layer", layer, layout_.num_layers);
  check_index("kv", static_cast<std::uint32_t>(kv), layout_.num_kv());
  check_index("page", page, layout_.num_pages);
  return {base() + layout_.block_offset(layer, kv, page),
          static_cast<std::size_t>(layout_.block_bytes())};
}

}  // namespace mstar::kv
