// Copyright mstar-kv authors.
//
// Done notices: the reader's half (KVTransferManager::notify_done) and the
// owner's (serve_done_notices into a KVCachePool). Epochs and lease expiry
// themselves live in pool.cpp and epochs.cpp.
#include <string>

#include "mstar/kv/engine.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/pool.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

void KVTransferEngine::notify_done(const KVTransferInfo& remote, std::uint64_t seq_id) {
  throw Error(StatusCode::kUnavailable,
              "the '" + remote.engine + "' engine has no channel back to the owner for the "
              "done notice of sequence " + std::to_string(seq_id) +
                  ": send it over the side channel that carried the SequenceInfo (the owner "
                  "calls KVCachePool::done)");
}

// Beside the other defaults of KVTransferEngine, so that an engine linked
// without the factory (manager.cpp) still finds its vtable's entries.
std::optional<KVLayout> KVTransferEngine::remote_layout(const KVTransferInfo& remote) const {
  (void)remote;
  return std::nullopt;
}

void KVTransferManager::notify_done(const SequenceInfo& seq) {
  if (seq.kv_transfer_info.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "done notice for sequence " + std::to_string(seq.seq_id) +
                    " with a local-only descriptor: there is no owner to tell");
  }
  engine_->notify_done(seq.kv_transfer_info, seq.seq_id);
}

void KVTransferManager::serve_done_notices(std::shared_ptr<KVCachePool> pool) {
  if (!pool) {
    engine_->set_done_handler(nullptr);
    return;
  }
  std::weak_ptr<KVCachePool> weak = pool;
  engine_->set_done_handler([weak](std::uint64_t seq_id, std::uint64_t epoch) {
    // A notice names the epoch it was published with: a late or forged
    // notice without it cannot free a newer request of the same id.
    if (epoch == 0) return;
    if (auto p = weak.lock()) p->done(seq_id, epoch);
  });
}

}  // namespace mstar::kv
