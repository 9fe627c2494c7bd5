// Copyright mstar-kv authors.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "copy_pool.hpp"
#include "engines/option_keys.hpp"
#include "mstar/kv/shm.hpp"
#include "shm_mapping.hpp"
#include "shm_memory.hpp"
#include "core/mapped_watch.hpp"
#include "core/planner_detail.hpp"
#include "mstar/kv/thread_annotations.hpp"

namespace mstar::kv {

namespace {

constexpr std::uint32_t kMaxWorkers = 256;
constexpr std::size_t kMaxCachedMappings = 64;

std::string human_bytes(std::uint64_t b) {
  if (b >= (1u << 20)) return std::to_string(b >> 20) + " MiB";
  if (b >= (1u << 10)) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

}  // namespace

struct ShmKVTransferEngine::Impl {
  Impl(std::shared_ptr<KVCache> c, ShmEngineOptions o)
      : cache(std::move(c)), options(o), pool(o.max_workers, o.timeout) {}

  // The mapping for this descriptor: cached per (pid, nonce), re-checked on
  // every use; a new generation of the same pid evicts the old one.
  std::shared_ptr<const ShmMapping> mapping_for(const ShmKVTransferInfo& info) {
    std::lock_guard<std::mutex> lock(map_mu);
    if (shut) {
      throw Error(StatusCode::kShutdown, "shm engine is shut down: no new reads");
    }
    const auto key = std::make_pair(info.pid, info.nonce);
    if (auto it = mappings.find(key); it != mappings.end()) {
      // The cached mapping came from a validated descriptor: its fields must
      // all match, or this descriptor is forged (e.g. another uid).
      if (!(it->second->info() == info)) {
        if (info.uid != it->second->info().uid) {
          throw Error(StatusCode::kPermissionDenied,
                      "shm descriptor names uid " + std::to_string(info.uid) +
                          " for a cache owned by uid " +
                          std::to_string(it->second->info().uid));
        }
        throw Error(StatusCode::kStaleDescriptor,
                    "shm descriptor for pid " + std::to_string(info.pid) +
                        " differs from the cache it names (fd, size, start time or layout)");
      }
      Status s = it->second->check_owner();
      if (s.is_ok()) return it->second;
      mappings.erase(it);  // in-flight reads keep their own reference
      throw Error(s);
    }
    // Any other generation of this pid is dead: drop it.
    for (auto it = mappings.begin(); it != mappings.end();) {
      it = it->first.first == info.pid ? mappings.erase(it) : std::next(it);
    }
    if (mappings.size() >= kMaxCachedMappings) {
      std::erase_if(mappings, [](const auto& kv) { return !kv.second->check_owner().is_ok(); });
      if (mappings.size() >= kMaxCachedMappings) mappings.erase(mappings.begin());
    }
    auto m = std::make_shared<const ShmMapping>(ShmMapping::open(info));
    mappings.emplace(key, m);
    return m;
  }

  std::shared_ptr<KVCache> cache;
  ShmEngineOptions options;
  shm::CopyPool pool;
  mutable std::mutex map_mu;
  bool shut MSTAR_KV_GUARDED_BY(map_mu) = false;
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::shared_ptr<const ShmMapping>>
      mappings MSTAR_KV_GUARDED_BY(map_mu);
};

namespace {

std::shared_ptr<KVCache> checked_cache(std::shared_ptr<KVCache> cache,
                                       const ShmEngineOptions& options) {
  if (!cache) throw Error(StatusCode::kInvalidArgument, "shm engine needs a KV cache, got null");
  if (cache->memory_kind() == MemoryKind::kDevice) {
    throw Error(StatusCode::kInvalidArgument,
                "shm engine needs a host cache (kSharedHost or kHost), got device memory "
                "(use the cuda_ipc engine)");
  }
  if (options.max_workers == 0 || options.max_workers > kMaxWorkers) {
    throw Error(StatusCode::kInvalidArgument,
                "shm engine max_workers " + std::to_string(options.max_workers) +
                    " out of range [1, " + std::to_string(kMaxWorkers) + "]");
  }
  // One rule for every engine (the RMA engines and cuda_ipc too): a timeout
  // of at least 1 ms; 0 failed every read over the inline size at once.
  if (options.timeout.count() <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "shm engine timeout " + std::to_string(options.timeout.count()) +
                    " ms out of range [1, ...)");
  }
  return cache;
}

}  // namespace

ShmKVTransferEngine::ShmKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                         ShmEngineOptions options)
    : impl_(std::make_unique<Impl>(checked_cache(std::move(kv_cache), options), options)) {}

ShmKVTransferEngine::ShmKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                         const TransferEngineInfo& info)
    : ShmKVTransferEngine(std::move(kv_cache), ShmEngineOptions::parse(info.options)) {}

ShmKVTransferEngine::~ShmKVTransferEngine() { shutdown(); }

std::optional<ShmKVTransferInfo> ShmKVTransferEngine::shm_info() const {
  const auto* mem = dynamic_cast<const shm::SharedMemory*>(&impl_->cache->memory());
  if (mem == nullptr) return std::nullopt;
  ShmKVTransferInfo info;
  info.pid = mem->owner_pid();
  info.fd = static_cast<std::uint32_t>(mem->fd());
  info.uid = mem->owner_uid();
  info.start_time = mem->owner_start_time();
  info.nonce = mem->nonce();
  info.size = mem->size();
  info.layout = impl_->cache->layout();
  return info;
}

KVTransferInfo ShmKVTransferEngine::get_kv_transfer_info() const {
  auto info = shm_info();
  return info ? info->encode() : KVTransferInfo{};
}

std::optional<KVLayout> ShmKVTransferEngine::remote_layout(const KVTransferInfo& remote) const {
  return ShmKVTransferInfo::decode(remote).layout;
}

std::optional<TransferFuture> ShmKVTransferEngine::read_batched_async(
    const KVTransferInfo& remote_kv_info, std::span<const KVReadInfo> read_info) {
  const ShmKVTransferInfo info = ShmKVTransferInfo::decode(remote_kv_info);
  const KVLayout& local = impl_->cache->layout();
  // Nothing to read: the descriptor is still validated (engine.hpp).
  local.check_same_model(info.layout);
  if (read_info.empty()) return std::nullopt;
  // Strided spans: a change of in-page order or head shard costs one span
  // per (read, k|v[, head]), copied by a tight row loop (copy_pool.hpp).
  // Many plain reads are only checked here (planned on the copy threads).
  const KVLayout remote = info.layout;
  StridedPlan plan;
  detail::PlainTotals piecewise;
  if (read_info.size() >= kPiecewiseReads &&
      detail::plain_same_geometry(local, remote, read_info)) {
    piecewise = detail::check_plain_reads(local, remote, read_info);
    if (piecewise.bytes <= kInlineCopyBytes) {  // copied here: planned here
      plan.spans.reserve(piecewise.spans);
      detail::emit_plain_strided(local, remote, read_info, plan);
      piecewise = {};
    } else {
      plan.total_bytes = piecewise.bytes;
    }
  } else {
    plan = plan_strided_copies(local, remote, read_info);
  }
  std::shared_ptr<const ShmMapping> mapping = impl_->mapping_for(info);
  // Seqlock over the owner's page epochs: every page must carry the
  // sequence's epoch before the copy and still after it.
  const std::uint64_t epoch = impl_->options.check_epochs ? remote_kv_info.epoch : 0;
  std::vector<std::uint32_t> pages;
  if (epoch != 0) {
    pages = remote_pages_of(read_info, info.layout.num_pages);
    Status s = check_page_epochs(mapping->epochs(), mapping->epoch_pages(), pages, epoch,
                                 "before the copy", false);
    if (!s.is_ok()) throw Error(std::move(s));
  }
  const auto planned_at = TransferTiming::Clock::now();
  std::string peer = "pid " + std::to_string(info.pid);
  if (plan.total_bytes <= kInlineCopyBytes) {
    // Handing a small read to a worker (queue, wake, resolve, wake the
    // waiter) costs tens of microseconds, more than the copy itself.
    TransferPromise promise;
    promise.mark_planned(plan.spans.size(), planned_at);
    promise.set_peer(std::move(peer));
    std::byte* dst = impl_->cache->base();
    const std::byte* src = mapping->data();
    for (const StridedSpan& s : plan.spans) shm::copy_span(dst, src, s);
    promise.mark_posted();  // the copy was the post
    if (epoch != 0) {
      Status s = check_page_epochs(mapping->epochs(), mapping->epoch_pages(), pages, epoch,
                                   "during the copy", true);
      if (!s.is_ok()) {
        promise.fail(std::move(s));
        return promise.future();
      }
    }
    promise.complete(plan.total_bytes);
    return promise.future();
  }
  shm::CopyJobSpec spec;
  spec.dst_base = impl_->cache->base();
  spec.src_base = mapping->data();
  spec.total_bytes = plan.total_bytes;
  spec.spans = std::move(plan.spans);
  if (piecewise.spans != 0) {
    spec.reads.assign(read_info.begin(), read_info.end());
    spec.plan = [local, remote](std::span<const KVReadInfo> reads, StridedPlan& out) {
      detail::emit_plain_strided(local, remote, reads, out);
    };
    spec.copies = piecewise.spans;
  }
  spec.what = "shm read of " + human_bytes(spec.total_bytes) + " (" +
              std::to_string(read_info.size()) + " page reads) from pid " +
              std::to_string(info.pid);
  if (epoch != 0) {
    spec.verify = [m = mapping.get(), pages = std::move(pages), epoch] {
      return check_page_epochs(m->epochs(), m->epoch_pages(), pages, epoch, "during the copy",
                               true);
    };
  }
  spec.keep_alive = std::move(mapping);
  spec.planned_at = planned_at;
  spec.peer = std::move(peer);
  const bool help = spec.total_bytes <= kHelpCopyBytes;
  return impl_->pool.submit(std::move(spec), help);
}

ShmEngineOptions ShmEngineOptions::parse(const EngineOptions& options) {
  // The shm engine has no options of its own: any shm_* key is a typo.
  engines::reject_unknown_keys(options.extra, "shm", "shm_", {});
  ShmEngineOptions o;
  o.max_workers = options.max_workers;
  o.timeout = options.timeout;
  o.check_epochs = options.check_epochs;
  return o;
}

std::unique_ptr<LayerWatch> ShmKVTransferEngine::watch_layers(
    const KVTransferInfo& remote_kv_info, std::span<const KVReadInfo> read_info) {
  if (read_info.empty()) {
    throw Error(StatusCode::kInvalidArgument, "shm layer watch of 0 reads: nothing to watch");
  }
  const ShmKVTransferInfo info = ShmKVTransferInfo::decode(remote_kv_info);
  const KVLayout& local = impl_->cache->layout();
  local.check_same_model(info.layout);
  (void)plan_strided_copies(local, info.layout, read_info);  // validates as a read does
  if (remote_kv_info.epoch == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "layer-wise streaming needs a descriptor with a page epoch (published by a "
                "KVCachePool), got epoch 0");
  }
  std::shared_ptr<const ShmMapping> mapping = impl_->mapping_for(info);
  auto pages = remote_pages_of(read_info, info.layout.num_pages);
  Status s = check_page_epochs(mapping->epochs(), mapping->epoch_pages(), pages,
                               remote_kv_info.epoch, "before the stream", false);
  if (!s.is_ok()) throw Error(std::move(s));
  const ShmMapping* m = mapping.get();
  return make_mapped_layer_watch(
      m->ready_words(), m->epochs(), m->epoch_pages(), info.layout.num_layers, std::move(pages),
      remote_kv_info.epoch, [m] { return m->check_owner(); }, std::move(mapping));
}

void ShmKVTransferEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(impl_->map_mu);
    impl_->shut = true;
  }
  impl_->pool.shutdown();
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  impl_->mappings.clear();
}

std::size_t ShmKVTransferEngine::cached_mappings() const {
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  return impl_->mappings.size();
}

}  // namespace mstar::kv
