// Copyright mstar-kv authors.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cma_anchor.hpp"
#include "cma_reader.hpp"
#include "copy_pool.hpp"
#include "core/mapped_watch.hpp"
#include "core/planner_detail.hpp"
#include "engines/engine_makers.hpp"
#include "engines/option_keys.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "shm_mapping.hpp"
#include "shm_memory.hpp"

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

// Where a read's bytes come from: the owner's memfd mapped here, or its
// private memory through cross-memory attach.
struct ShmSource {
  std::shared_ptr<const ShmMapping> mapping;
  std::shared_ptr<const shm::CmaPeer> cma;

  // The seqlock over the owner's page epochs (`pages`; sorted for cma):
  // every page carries `epoch` before the copy and still after it; through
  // cma the anchor's nonce is read with them (epoch 0 too).
  Status check(std::span<const std::uint32_t> pages, std::uint64_t epoch, const char* when,
               bool after_copy) const {
    if (cma) return cma->verify(pages, epoch, when, after_copy);
    if (epoch == 0) return Status::ok();
    return check_page_epochs(mapping->epochs(), mapping->epoch_pages(), pages, epoch, when,
                             after_copy);
  }
  std::shared_ptr<const void> keep() const {
    return cma ? std::shared_ptr<const void>(cma) : std::shared_ptr<const void>(mapping);
  }
};

struct ShmKVTransferEngine::Impl {
  Impl(std::shared_ptr<KVCache> c, ShmEngineOptions o)
      : cache(std::move(c)), options(o), pool(o.max_workers, o.timeout) {
    // A private cache is served through cross-memory attach (cma_anchor.hpp).
    if (dynamic_cast<const shm::SharedMemory*>(&cache->memory()) == nullptr || cache->split()) {
      anchor = std::make_unique<shm::CmaAnchor>(*cache, o.map_private);
    }
  }

  ShmSource source_for(const ShmKVTransferInfo& info) {
    if (info.access == ShmKVTransferInfo::Access::kCma) return {nullptr, cma_for(info)};
    return {mapping_for(info), nullptr};
  }

  // The peer for a kCma descriptor: cached per (pid, nonce) as mappings are.
  std::shared_ptr<const shm::CmaPeer> cma_for(const ShmKVTransferInfo& info) {
    std::lock_guard<std::mutex> lock(map_mu);
    return cached_for(
        peers, info,
        [&](const shm::CmaPeer& p) {
          throw Error(StatusCode::kStaleDescriptor,
                      p.who() +
                          ": the descriptor differs from the one this reader "
                          "opened under the same nonce (a forged descriptor)");
        },
        [](const shm::CmaPeer& p) { return p.check_alive(); },
        [&] { return shm::CmaPeer::open(info); });
  }

  // The mapping for this descriptor: cached per (pid, nonce), re-checked on
  // every use; a new generation of the same pid evicts the old one.
  std::shared_ptr<const ShmMapping> mapping_for(const ShmKVTransferInfo& info) {
    std::lock_guard<std::mutex> lock(map_mu);
    return cached_for(
        mappings, info,
        [&](const ShmMapping& m) {
          // The cached mapping came from a validated descriptor: its fields
          // must all match, or this descriptor is forged (e.g. another uid).
          if (info.uid != m.info().uid) {
            throw Error(StatusCode::kPermissionDenied,
                        "shm descriptor names uid " + std::to_string(info.uid) +
                            " for a cache owned by uid " + std::to_string(m.info().uid));
          }
          throw Error(StatusCode::kStaleDescriptor,
                      "shm descriptor for pid " + std::to_string(info.pid) +
                          " differs from the cache it names (fd, size, start time or layout)");
        },
        [](const ShmMapping& m) { return m.check_owner(); },
        [&] { return std::make_shared<const ShmMapping>(ShmMapping::open(info)); });
  }

  // What the two caches above share. The entry for (pid, nonce) if its
  // descriptor is this one (else `mismatch` throws) and its owner is alive
  // (else it is dropped, in-flight reads keeping their own reference, and the
  // owner's status thrown); otherwise a new one from `open`, after dropping
  // every other generation of the pid (dead) and, at the limit, dead entries
  // or the oldest.
  template <typename T, typename Mismatch, typename Alive, typename Open>
  std::shared_ptr<const T> cached_for(
      std::map<std::pair<std::uint32_t, std::uint64_t>, std::shared_ptr<const T>>& cached,
      const ShmKVTransferInfo& info, Mismatch mismatch, Alive alive, Open open)
      MSTAR_KV_REQUIRES(map_mu) {
    if (shut) {
      throw Error(StatusCode::kShutdown, "shm engine is shut down: no new reads");
    }
    const auto key = std::make_pair(info.pid, info.nonce);
    if (auto it = cached.find(key); it != cached.end()) {
      if (!(it->second->info() == info)) mismatch(*it->second);
      Status s = alive(*it->second);
      if (s.is_ok()) return it->second;
      cached.erase(it);
      throw Error(s);
    }
    for (auto it = cached.begin(); it != cached.end();) {
      it = it->first.first == info.pid ? cached.erase(it) : std::next(it);
    }
    if (cached.size() >= kMaxCachedMappings) {
      std::erase_if(cached, [&](const auto& kv) { return !alive(*kv.second).is_ok(); });
      if (cached.size() >= kMaxCachedMappings) cached.erase(cached.begin());
    }
    std::shared_ptr<const T> made = open();
    cached.emplace(key, made);
    return made;
  }

  std::shared_ptr<KVCache> cache;
  ShmEngineOptions options;
  shm::CopyPool pool;
  mutable std::mutex map_mu;
  bool shut MSTAR_KV_GUARDED_BY(map_mu) = false;
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::shared_ptr<const ShmMapping>> mappings
      MSTAR_KV_GUARDED_BY(map_mu);
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::shared_ptr<const shm::CmaPeer>> peers
      MSTAR_KV_GUARDED_BY(map_mu);
  std::unique_ptr<shm::CmaAnchor> anchor;  // serving a private cache
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
  engines::check_workers_and_timeout(options, "shm engine", kMaxWorkers);
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
  if (impl_->anchor) return impl_->anchor->info();
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

RemoteHandle ShmKVTransferEngine::open_remote(const KVTransferInfo& remote) const {
  ShmKVTransferInfo info = ShmKVTransferInfo::decode(remote);
  impl_->cache->layout().check_same_model(info.layout);
  KVLayout layout = info.layout;
  return std::make_shared<TypedRemote<ShmKVTransferInfo>>(remote, std::move(info), layout);
}

std::optional<TransferFuture> ShmKVTransferEngine::read_batched_async(
    const RemoteCache& remote_cache, std::span<const KVReadInfo> read_info) {
  const ShmKVTransferInfo& info = remote_as<ShmKVTransferInfo>(remote_cache, "shm");
  const KVLayout& local = impl_->cache->layout();
  if (read_info.empty()) return std::nullopt;  // the descriptor was validated by open_remote
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
  const ShmSource src = impl_->source_for(info);
  // Seqlock over the owner's page epochs: every page must carry the
  // sequence's epoch before the copy and still after it.
  const std::uint64_t epoch = impl_->options.check_epochs ? remote_cache.epoch() : 0;
  std::vector<std::uint32_t> pages;
  if (epoch != 0) {
    pages = remote_pages_of(read_info, info.layout.num_pages);
    if (src.cma) std::sort(pages.begin(), pages.end());  // runs of pages read at once
  }
  if (Status s = src.check(pages, epoch, "before the copy", false); !s.is_ok()) {
    throw Error(std::move(s));
  }
  const auto planned_at = TransferTiming::Clock::now();
  std::string peer = "pid " + std::to_string(info.pid);
  const RegionMap& dst = impl_->cache->regions();
  const RegionMap src_map =
      src.mapping ? RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(src.mapping->data()))
                  : RegionMap();
  if (plan.total_bytes <= kInlineCopyBytes) {
    // Handing a small read to a worker (queue, wake, resolve, wake the
    // waiter) costs tens of microseconds, more than the copy itself.
    TransferPromise promise;
    promise.mark_planned(plan.spans.size(), planned_at);
    promise.set_peer(std::move(peer));
    if (src.cma) {
      Status s = src.cma->copy(dst, plan.spans.data(), plan.spans.data() + plan.spans.size());
      if (!s.is_ok()) {
        promise.fail(std::move(s));
        return promise.future();
      }
    } else {
      for (const StridedSpan& s : plan.spans) {
        shm::copy_span_at(dst.pointer(s.local_offset),
                          src_map.pointer<const std::byte>(s.remote_offset), s, false, nullptr,
                          nullptr);
      }
    }
    promise.mark_posted();  // the copy was the post
    if (Status s = src.check(pages, epoch, "during the copy", true); !s.is_ok()) {
      promise.fail(std::move(s));
      return promise.future();
    }
    promise.complete(plan.total_bytes);
    return promise.future();
  }
  shm::CopyJobSpec spec;
  spec.dst = dst;
  spec.src = src_map;
  spec.cma = src.cma.get();
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
              std::to_string(info.pid) + (src.cma ? " (cross-memory attach)" : "");
  if (epoch != 0 || src.cma) {
    spec.verify = [src, pages = std::move(pages), epoch] {
      return src.check(pages, epoch, "during the copy", true);
    };
  }
  spec.keep_alive = src.keep();
  spec.planned_at = planned_at;
  spec.peer = std::move(peer);
  const bool help = spec.total_bytes <= kHelpCopyBytes;
  return impl_->pool.submit(std::move(spec), help);
}

void ShmKVTransferEngine::connect(const RemoteCache& remote_cache) {
  (void)impl_->source_for(remote_as<ShmKVTransferInfo>(remote_cache, "shm"));
}

ShmEngineOptions ShmEngineOptions::parse(const EngineOptions& options) {
  // Any other shm_* key is a typo.
  engines::reject_unknown_keys(options.extra, "shm", "shm_", {"shm_map_private"});
  ShmEngineOptions o;
  o.max_workers = options.max_workers;
  o.timeout = options.timeout;
  o.check_epochs = options.check_epochs;
  // The option wins over the environment (MSTAR_KV_SHM_MAP_PRIVATE: test and
  // benchmark setups of a whole process).
  if (auto it = options.extra.find("shm_map_private"); it != options.extra.end()) {
    if (!it->second.empty()) {
      o.map_private = engines::parse_on_off(it->second, "shm option shm_map_private");
    }
  } else if (const char* env = std::getenv("MSTAR_KV_SHM_MAP_PRIVATE"); env != nullptr && *env) {
    o.map_private = engines::parse_on_off(env, "MSTAR_KV_SHM_MAP_PRIVATE");
  }
  return o;
}

std::unique_ptr<LayerWatch> ShmKVTransferEngine::watch_layers(
    const RemoteCache& remote_cache, std::span<const KVReadInfo> read_info) {
  if (read_info.empty()) {
    throw Error(StatusCode::kInvalidArgument, "shm layer watch of 0 reads: nothing to watch");
  }
  const ShmKVTransferInfo& info = remote_as<ShmKVTransferInfo>(remote_cache, "shm");
  const std::uint64_t epoch = remote_cache.epoch();
  const KVLayout& local = impl_->cache->layout();
  (void)plan_strided_copies(local, info.layout, read_info);  // validates as a read does
  if (epoch == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "layer-wise streaming needs a descriptor with a page epoch (published by a "
                "KVCachePool), got epoch 0");
  }
  const ShmSource src = impl_->source_for(info);
  auto pages = remote_pages_of(read_info, info.layout.num_pages);
  if (src.cma) std::sort(pages.begin(), pages.end());
  if (Status s = src.check(pages, epoch, "before the stream", false); !s.is_ok()) {
    throw Error(std::move(s));
  }
  if (src.cma) return shm::CmaPeer::watch(src.cma, std::move(pages), epoch);
  const ShmMapping* m = src.mapping.get();
  return make_mapped_layer_watch(
      m->ready_words(), m->epochs(), m->epoch_pages(), info.layout.num_layers, std::move(pages),
      epoch, [m] { return m->check_owner(); }, src.mapping);
}

void ShmKVTransferEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(impl_->map_mu);
    impl_->shut = true;
  }
  impl_->pool.shutdown();
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  impl_->mappings.clear();
  impl_->peers.clear();
}

std::size_t ShmKVTransferEngine::cached_mappings() const {
  std::lock_guard<std::mutex> lock(impl_->map_mu);
  return impl_->mappings.size() + impl_->peers.size();
}

namespace engines {

EngineHooks hooks_shm() {
  EngineHooks h;
  h.make = &make<ShmKVTransferEngine>;
  h.allocate = [](const KVLayout& layout, int) -> std::unique_ptr<KVMemory> {
    return shm::SharedMemory::create(layout.total_bytes(), layout.num_pages);
  };
  return h;
}

}  // namespace engines

}  // namespace mstar::kv
