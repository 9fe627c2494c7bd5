// Copyright mstar-kv authors.
#include "mstar/kv/core/cache.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

// Anonymous mmap: page-aligned, zero-filled, returned to the OS on free.
class HostMemory final : public KVMemory {
 public:
  static constexpr std::size_t kHugePage = 2u << 20;
  explicit HostMemory(std::size_t size) : size_(size) {
    void* p = ::mmap(nullptr, size_ == 0 ? 1 : size_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(StatusCode::kRetryLater, "cannot allocate " + std::to_string(size_) +
                                               " bytes of host memory: " + std::strerror(errno));
    }
    data_ = static_cast<std::byte*>(p);
    // Transparent huge pages where the kernel gives them on request
    // ("madvise" mode): a reader of another process's cache pins its pages
    // one by one (cross-memory attach), in 2 MiB ones 1.5-2x faster
    // (measured on a 6.18 VM); fewer TLB misses in every copy besides. Only
    // a hint: the cache works the same without.
    if (size_ >= kHugePage) (void)::madvise(p, size_, MADV_HUGEPAGE);
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
    throw Error(StatusCode::kInvalidArgument, std::string(what) + " " + std::to_string(value) +
                                                  " out of range [0, " + std::to_string(limit) +
                                                  ")");
  }
}

}  // namespace

std::unique_ptr<KVMemory> allocate_host_memory(std::size_t size) {
  return std::make_unique<HostMemory>(size);
}

KVCache::KVCache(const KVLayout& layout, std::unique_ptr<KVMemory> memory) : layout_(layout) {
  layout_.validate();
  if (!memory) {
    throw Error(StatusCode::kInvalidArgument, "KVCache needs memory, got null");
  }
  if (memory->size() < layout_.total_bytes()) {
    throw Error(StatusCode::kInvalidArgument, "KVCache memory of " +
                                                  std::to_string(memory->size()) +
                                                  " bytes is smaller than the layout's " +
                                                  std::to_string(layout_.total_bytes()) + " bytes");
  }
  regions_ = RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(memory->data()));
  memories_.push_back(std::move(memory));
  bind_tables(memories_.front().get());
}

KVCache::KVCache(const KVLayout& layout, std::vector<std::unique_ptr<KVMemory>> layer_memories)
    : layout_(layout), memories_(std::move(layer_memories)) {
  layout_.validate();
  if (!layout_.layer_contiguous()) {
    throw Error(StatusCode::kInvalidArgument,
                "a KVCache of one region per layer needs a layout whose layers are contiguous "
                "(layer-major or layer-page), got " +
                    std::string(to_string(layout_.cache_order)) +
                    "-major: its layers interleave page by page, so they cannot live apart");
  }
  if (memories_.size() != layout_.num_layers) {
    throw Error(StatusCode::kInvalidArgument,
                "a KVCache of one region per layer needs " + std::to_string(layout_.num_layers) +
                    " memories (the layout's num_layers), got " + std::to_string(memories_.size()));
  }
  const std::uint64_t need = layout_.layer_bytes();
  std::vector<std::uint64_t> bases;
  std::vector<NamedRange> ranges;
  bases.reserve(memories_.size());
  for (std::size_t l = 0; l < memories_.size(); ++l) {
    const KVMemory* m = memories_[l].get();
    if (m == nullptr) {
      throw Error(StatusCode::kInvalidArgument,
                  "KVCache layer " + std::to_string(l) + " has no memory (null)");
    }
    if (m->size() < need) {
      throw Error(StatusCode::kInvalidArgument,
                  "KVCache layer " + std::to_string(l) + " memory of " + std::to_string(m->size()) +
                      " bytes is smaller than the layer's " + std::to_string(need) + " bytes");
    }
    if (m->kind() != memories_.front()->kind()) {
      throw Error(StatusCode::kInvalidArgument,
                  "KVCache layer " + std::to_string(l) + " memory is of kind " +
                      std::to_string(static_cast<int>(m->kind())) + ", layer 0's of kind " +
                      std::to_string(static_cast<int>(memories_.front()->kind())) +
                      ": every layer must live in one kind of memory");
    }
    const auto address = reinterpret_cast<std::uintptr_t>(m->data());
    bases.push_back(address);
    ranges.push_back({"layer " + std::to_string(l), address, need});
  }
  check_disjoint(std::move(ranges), StatusCode::kInvalidArgument, "KVCache regions");
  regions_ = RegionMap::per_layer(layout_, std::move(bases));
  bind_tables(nullptr);
}

// The page epochs and readiness words: where `tables_from` keeps them, else
// in private host memory.
void KVCache::bind_tables(KVMemory* tables_from) {
  // The mirror first: a memory may make its host tables with it (cuda_ipc).
  const EpochMirror* mirror =
      tables_from != nullptr ? tables_from->epoch_mirror(layout_.num_pages) : nullptr;
  std::uint64_t* words =
      tables_from != nullptr ? tables_from->epoch_words(layout_.num_pages) : nullptr;
  if (words == nullptr) {
    epoch_memory_ = allocate_host_memory(std::size_t{layout_.num_pages} * 8);
    words = reinterpret_cast<std::uint64_t*>(epoch_memory_->data());
  }
  epochs_ = PageEpochs(words, layout_.num_pages, mirror);
  std::uint32_t* ready =
      tables_from != nullptr ? tables_from->ready_words(layout_.num_pages) : nullptr;
  if (ready == nullptr) {
    ready_memory_ = allocate_host_memory(std::size_t{layout_.num_pages} * 4);
    ready = reinterpret_cast<std::uint32_t*>(ready_memory_->data());
  }
  readiness_ = PageReadiness(ready, layout_.num_pages);
}

std::shared_ptr<KVCache> KVCache::create_host(const KVLayout& layout) {
  layout.validate();
  return std::make_shared<KVCache>(layout, allocate_host_memory(layout.total_bytes()));
}

std::shared_ptr<KVCache> KVCache::create_host_layers(const KVLayout& layout) {
  layout.validate();
  std::vector<std::unique_ptr<KVMemory>> layers;
  layers.reserve(layout.num_layers);
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    layers.push_back(allocate_host_memory(layout.layer_bytes()));
  }
  return std::make_shared<KVCache>(layout, std::move(layers));
}

std::span<std::byte> KVCache::block(std::uint32_t layer, KV kv, std::uint32_t page) const {
  check_index("layer", layer, layout_.num_layers);
  check_index("kv", static_cast<std::uint32_t>(kv), layout_.num_kv());
  check_index("page", page, layout_.num_pages);
  return {at(layout_.block_offset(layer, kv, page)),
          static_cast<std::size_t>(layout_.block_bytes())};
}

}  // namespace mstar::kv
