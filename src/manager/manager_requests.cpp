// Copyright mstar-kv authors.
//
// KVTransferManager's request-scoped descriptors (requests.hpp): publishing
// a request's pages with their epochs, owning, removing, and reading them.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>

#include "manager/issue_reads.hpp"
#include "manager/request_registry.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

std::string new_owner_id() {
  std::random_device rd;
  std::string id;
  id.reserve(32);
  for (int i = 0; i < 4; ++i) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", static_cast<unsigned>(rd()));
    id += buf;
  }
  return id;
}

std::string who(const RequestKVTransferInfo& d) {
  return "request '" + d.request_id + "' label '" + d.label + "'";
}

void check_resource(const RequestKVTransferInfo& d, const ResourceScope& scope) {
  if (d.resource_key != scope.resource_key) {
    throw Error(StatusCode::kInvalidArgument,
                "a descriptor of resource '" + d.resource_key + "' (" + who(d) +
                    ") given to the manager of resource '" + scope.resource_key + "'");
  }
}

// The caller's remote table where [start_len, end_len) reads it must be the
// descriptor's: upstream passes the table it received beside the
// descriptor, and a page of another table would carry another request's KV.
void check_table(const RequestKVTransferInfo& d, std::uint32_t page_size, std::uint64_t start_len,
                 std::uint64_t end_len, std::span<const std::uint32_t> remote_pages) {
  if (start_len >= end_len) return;
  const std::uint64_t first = start_len / page_size;
  const std::uint64_t last = (end_len - 1) / page_size;
  for (std::uint64_t i = first; i <= last && i < remote_pages.size(); ++i) {
    if (remote_pages[i] != d.page_indices[i]) {
      throw Error(StatusCode::kInvalidArgument, "remote_page_indices[" + std::to_string(i) +
                                                    "] = " + std::to_string(remote_pages[i]) +
                                                    ", but " + who(d) + " published page " +
                                                    std::to_string(d.page_indices[i]) + " there");
    }
  }
}

}  // namespace

void KVTransferManager::init_requests(ResourceScope scope) {
  if (scope.resource_key.size() > RequestKVTransferInfo::kMaxNameBytes) {
    throw Error(StatusCode::kInvalidArgument,
                "resource_key of " + std::to_string(scope.resource_key.size()) +
                    " bytes exceeds the limit of " +
                    std::to_string(RequestKVTransferInfo::kMaxNameBytes));
  }
  scope_ = std::move(scope);
  owner_ = new_owner_id();
  requests_ = std::make_unique<RequestRegistry>(kv_cache_);
}

KVTransferInfo KVTransferManager::cache_info() {
  {
    std::lock_guard<std::mutex> lock(cache_info_mu_);
    if (cache_info_) return *cache_info_;
  }
  // Outside the lock: a Python engine's takes the GIL.
  KVTransferInfo info = engine_->get_kv_transfer_info();
  std::lock_guard<std::mutex> lock(cache_info_mu_);
  if (!cache_info_) cache_info_ = std::move(info);
  return *cache_info_;
}

std::optional<RequestKVTransferInfo> KVTransferManager::get_kv_transfer_info(
    const RequestPublication& p) {
  check_open("get_kv_transfer_info");
  if (!scope_.needs_remote_transfer) return std::nullopt;
  KVTransferInfo cache = cache_info();
  if (cache.empty()) return std::nullopt;  // local-only: nothing to publish
  if (cache.payload.empty()) {
    throw Error(StatusCode::kNotSupported,
                "the " + engine_->name() +
                    " engine's descriptors are its own Python objects, not a KVTransferInfo: "
                    "request-scoped descriptors need one");
  }
  cache.epoch = 0;
  RequestKVTransferInfo d;
  d.page_epochs = requests_->publish(p);  // validates first
  d.resource_key = scope_.resource_key;
  d.request_id = p.request_id;
  d.label = p.label;
  d.reset_generation = p.reset_generation;
  d.seq_len = p.seq_len;
  d.page_size = kv_cache_->layout().page_size;
  d.page_indices = p.page_indices;
  d.owner = owner_;
  d.cache = std::move(cache);
  return d;
}

bool KVTransferManager::owns_transfer_info(const RequestKVTransferInfo& info,
                                           std::string_view request_id,
                                           std::string_view label) const {
  check_open("owns_transfer_info");
  return info.owner == owner_ && info.resource_key == scope_.resource_key &&
         info.request_id == request_id && info.label == label &&
         requests_->holds(request_id, label);
}

void KVTransferManager::remove_request(std::string_view request_id) {
  check_open("remove_request");
  requests_->remove(request_id);
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve_request(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RequestKVTransferInfo& info) {
  check_open("start_async_retrieve");
  return tracked([&]() -> std::optional<TransferFuture> {
    const KVLayout& local = kv_cache_->layout();
    check_local_pages(local, start_len, end_len, local_page_indices);
    check_resource(info, scope_);
    if (end_len > info.seq_len) {
      throw Error(StatusCode::kInvalidArgument, "tokens [" + std::to_string(start_len) + ", " +
                                                    std::to_string(end_len) + ") beyond the " +
                                                    std::to_string(info.seq_len) + " tokens " +
                                                    who(info) + " published");
    }
    std::vector<RemoteHandle> opened{engine_->open_remote(
        info.with_epoch(info.page_epochs.empty() ? 0 : info.page_epochs.front()))};
    const std::optional<KVLayout>& rl = opened.front()->layout();
    if (rl && rl->page_size != info.page_size) {
      throw Error(StatusCode::kCorruptDescriptor,
                  "the descriptor of " + who(info) + " says " + std::to_string(info.page_size) +
                      " tokens per page, its cache " + std::to_string(rl->page_size));
    }
    check_table(info, info.page_size, start_len, end_len, remote_page_indices);
    auto reads = plan_retrieve(local, *opened.front(), start_len, end_len, local_page_indices,
                               remote_page_indices);
    return read_scoped(info, opened, reads);
  });
}

std::optional<TransferFuture> KVTransferManager::read_request_async(
    const RequestKVTransferInfo& info, std::span<const KVReadInfo> read_info) {
  check_open("read_request_async");
  return tracked([&]() -> std::optional<TransferFuture> {
    check_resource(info, scope_);
    std::vector<RemoteHandle> opened{engine_->open_remote(
        info.with_epoch(info.page_epochs.empty() ? 0 : info.page_epochs.front()))};
    return read_scoped(info, opened, read_info);
  });
}

std::optional<TransferFuture> KVTransferManager::read_scoped(const RequestKVTransferInfo& info,
                                                             std::vector<RemoteHandle>& opened,
                                                             std::span<const KVReadInfo> reads) {
  // Every read's page and tokens against the publication, grouped by the
  // epoch its page carried when published.
  std::unordered_map<std::uint32_t, std::size_t> position;
  position.reserve(info.page_indices.size());
  for (std::size_t i = 0; i < info.page_indices.size(); ++i) {
    position.emplace(info.page_indices[i], i);
  }
  if (reads.empty()) {
    // Still to the engine, which validates the handle; nothing to read.
    engine_->read_batched_async(*opened.front(), reads);
    return std::nullopt;
  }
  auto epoch_of = [&](const KVReadInfo& r) -> std::uint64_t {
    auto it = r.remote_page_idx < 0 || r.remote_page_idx > UINT32_MAX
                  ? position.end()
                  : position.find(static_cast<std::uint32_t>(r.remote_page_idx));
    if (it == position.end()) {
      throw Error(StatusCode::kInvalidArgument, "remote page " + std::to_string(r.remote_page_idx) +
                                                    " is not one of the " +
                                                    std::to_string(info.page_indices.size()) +
                                                    " pages " + who(info) + " published");
    }
    const std::int64_t first = r.remote_token_start >= 0 ? r.remote_token_start : r.token_start;
    const std::int64_t end = first + (r.token_end - r.token_start);
    const std::uint64_t seq_end = std::uint64_t{it->second} * info.page_size +
                                  static_cast<std::uint64_t>(std::max<std::int64_t>(end, 0));
    if (r.token_end > r.token_start && seq_end > info.seq_len) {
      throw Error(StatusCode::kInvalidArgument,
                  "tokens [" + std::to_string(first) + ", " + std::to_string(end) +
                      ") of remote page " + std::to_string(r.remote_page_idx) + " reach token " +
                      std::to_string(seq_end) + ", beyond the " + std::to_string(info.seq_len) +
                      " tokens " + who(info) + " published");
    }
    return info.page_epochs[it->second];
  };
  return issue_by_epoch(*engine_, reads, epoch_of, opened, [&](std::uint64_t epoch) {
    return engine_->open_remote(info.with_epoch(epoch));
  });
}

}  // namespace mstar::kv
