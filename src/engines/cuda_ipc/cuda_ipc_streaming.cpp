// Copyright mstar-kv authors.
//
// Layer-wise streaming on the cuda_ipc engine (cuda_ipc.hpp "Layer
// readiness"): the reader's watch over an owner's host tables, and the
// owner's mark enqueued on a CUDA stream.
#include "core/mapped_watch.hpp"
#include "cuda_ipc_impl.hpp"
#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/util/log.hpp"

namespace mstar::kv {

std::unique_ptr<LayerWatch> CudaIpcKVTransferEngine::Impl::watch_layers(
    const RemoteCache& remote_cache, std::span<const KVReadInfo> reads) {
  {
    std::shared_lock lifecycle(lifecycle_mu_);
    if (shut_down_) throw Error(StatusCode::kShutdown, "cuda_ipc engine is shut down");
  }
  if (reads.empty()) {
    throw Error(StatusCode::kInvalidArgument, "cuda_ipc layer watch of 0 reads: nothing to watch");
  }
  const CudaIpcKVTransferInfo& remote = remote_as<CudaIpcKVTransferInfo>(remote_cache, "cuda_ipc");
  const std::uint64_t epoch = remote_cache.epoch();
  (void)plan_strided_copies(cache_->layout(), remote.layout, reads);  // validates as a read does
  if (epoch == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "layer-wise streaming needs a descriptor with a page epoch (published by a "
                "KVCachePool), got epoch 0");
  }
  if (!remote.has_host_tables) {
    throw Error(StatusCode::kNotSupported,
                "cuda_ipc descriptor of pid " + std::to_string(remote.owner_pid) +
                    " carries no host tables (the owner could not make them, or the descriptor "
                    "came from a bare cuda_share): no layer readiness to watch; pull after the "
                    "owner finished instead");
  }
  const std::uint32_t num_pages = remote.layout.num_pages;
  auto tables = std::make_shared<const cuda_ipc::HostTablesView>(
      remote.owner_pid, remote.host_tables_fd, remote.host_tables_uid, remote.generation,
      num_pages);
  auto pages = remote_pages_of(reads, num_pages);
  Status s =
      check_page_epochs(tables->epochs(), num_pages, pages, epoch, "before the stream", false);
  if (!s.is_ok()) throw Error(std::move(s));
  const cuda_ipc::HostTablesView* t = tables.get();
  return make_mapped_layer_watch(
      t->ready(), t->epochs(), num_pages, remote.layout.num_layers, std::move(pages), epoch,
      [t] { return t->check_owner(); }, std::move(tables));
}

namespace {

struct PendingMark {
  std::shared_ptr<KVCachePool> pool;
  std::uint64_t seq_id;
  std::uint32_t layers;
};

// CUDA's callback thread: no CUDA call allowed here, none made (the pool
// stamps host words only).
void CUDART_CB run_mark(void* arg) noexcept {
  std::unique_ptr<PendingMark> m(static_cast<PendingMark*>(arg));
  try {
    m->pool->mark_layers_ready(m->seq_id, m->layers);
  } catch (const std::exception& e) {
    Logger::from_env().warn("mark_layers_ready_after: the mark of " + std::to_string(m->layers) +
                            " layers of sequence " + std::to_string(m->seq_id) +
                            " was refused: " + e.what());
  }
}

}  // namespace

void mark_layers_ready_after(std::shared_ptr<KVCachePool> pool, std::uint64_t seq_id,
                             std::uint32_t layers, void* cuda_stream) {
  if (!pool) throw Error(StatusCode::kInvalidArgument, "mark_layers_ready_after: null pool");
  auto m = std::make_unique<PendingMark>(PendingMark{std::move(pool), seq_id, layers});
  const cudaError_t err =
      cudaLaunchHostFunc(static_cast<cudaStream_t>(cuda_stream), run_mark, m.get());
  if (err != cudaSuccess) {
    cuda_ipc::fail(StatusCode::kInternal, "cudaLaunchHostFunc (mark_layers_ready_after)", err);
  }
  (void)m.release();  // run_mark owns it now
}

}  // namespace mstar::kv
