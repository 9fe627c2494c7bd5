// Copyright mstar-kv authors.
#include "manager/request_registry.hpp"

#include <string>
#include <unordered_map>
#include <utility>

#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

void check_name(const std::string& value, const char* what) {
  if (value.size() > RequestKVTransferInfo::kMaxNameBytes) {
    throw Error(StatusCode::kInvalidArgument,
                std::string(what) + " of " + std::to_string(value.size()) +
                    " bytes exceeds the limit of " +
                    std::to_string(RequestKVTransferInfo::kMaxNameBytes));
  }
}

}  // namespace

RequestRegistry::RequestRegistry(std::shared_ptr<KVCache> cache)
    : cache_(std::move(cache)),
      holders_(cache_->layout().num_pages, 0),
      next_epoch_(random_first_epoch()) {}

void RequestRegistry::validate(const RequestPublication& p) const {
  check_name(p.request_id, "request_id");
  check_name(p.label, "label");
  const KVLayout& layout = cache_->layout();
  const std::string who = "request '" + p.request_id + "' label '" + p.label + "'";
  if (p.page_indices.size() > DescriptorLimits::kMaxPagesPerSequence) {
    throw Error(StatusCode::kInvalidArgument,
                who + ": " + std::to_string(p.page_indices.size()) + " pages exceed the limit of " +
                    std::to_string(DescriptorLimits::kMaxPagesPerSequence));
  }
  std::unordered_map<std::uint32_t, std::size_t> first;
  first.reserve(p.page_indices.size());
  for (std::size_t i = 0; i < p.page_indices.size(); ++i) {
    const std::uint32_t page = p.page_indices[i];
    if (page >= layout.num_pages) {
      throw Error(StatusCode::kInvalidArgument,
                  who + ": page_indices[" + std::to_string(i) + "] = " + std::to_string(page) +
                      " out of range [0, " + std::to_string(layout.num_pages) + ")");
    }
    auto [it, fresh] = first.emplace(page, i);
    if (!fresh) {
      throw Error(StatusCode::kInvalidArgument,
                  who + ": page_indices[" + std::to_string(i) + "] = " + std::to_string(page) +
                      " is also page_indices[" + std::to_string(it->second) +
                      "]: a page holds one place of a sequence");
    }
  }
  const std::uint64_t room = std::uint64_t{layout.page_size} * p.page_indices.size();
  if (p.seq_len > room) {
    throw Error(StatusCode::kInvalidArgument, who + ": seq_len " + std::to_string(p.seq_len) +
                                                  " beyond the " + std::to_string(room) +
                                                  " tokens of its " +
                                                  std::to_string(p.page_indices.size()) +
                                                  " pages of " + std::to_string(layout.page_size));
  }
}

std::vector<std::uint64_t> RequestRegistry::publish(const RequestPublication& p) {
  validate(p);
  const PageEpochs& table = cache_->epochs();
  std::lock_guard<std::mutex> lock(mu_);
  Labels& labels = requests_[p.request_id];
  auto it = labels.find(p.label);
  Publication* old = it == labels.end() ? nullptr : &it->second;
  if (old != nullptr && old->generation == p.reset_generation && old->pages == p.page_indices &&
      old->seq_len == p.seq_len) {
    return old->epochs;  // the same publication: the same descriptor
  }
  const bool same_generation = old != nullptr && old->generation == p.reset_generation;
  std::unordered_map<std::uint32_t, bool> kept;  // the old pages: still named?
  if (old != nullptr) {
    for (std::uint32_t page : old->pages) kept.emplace(page, false);
  }
  // Which pages get a fresh epoch (requests.hpp): free ones, and ones this
  // publication alone held under another generation.
  std::vector<bool> fresh(p.page_indices.size(), false);
  std::vector<std::uint32_t> to_stamp;
  for (std::size_t i = 0; i < p.page_indices.size(); ++i) {
    const std::uint32_t page = p.page_indices[i];
    auto k = kept.find(page);
    if (k != kept.end()) {
      k->second = true;
      fresh[i] = !same_generation && holders_[page] == 1;
    } else {
      fresh[i] = holders_[page] == 0;
      ++holders_[page];
    }
    if (fresh[i]) to_stamp.push_back(page);
  }
  std::vector<std::uint32_t> dropped;
  for (const auto& [page, still] : kept) {
    if (!still) dropped.push_back(page);
  }
  release_locked(dropped);
  const std::uint64_t epoch = to_stamp.empty() ? 0 : next_epoch_++;
  if (!to_stamp.empty()) table.stamp(to_stamp, epoch);

  Publication next{p.reset_generation, p.page_indices, p.seq_len, {}};
  next.epochs.reserve(p.page_indices.size());
  for (std::size_t i = 0; i < p.page_indices.size(); ++i) {
    next.epochs.push_back(fresh[i] ? epoch : table.load(p.page_indices[i]));
  }
  std::vector<std::uint64_t> epochs = next.epochs;
  if (old != nullptr) {
    *old = std::move(next);
  } else {
    labels.emplace(p.label, std::move(next));
  }
  return epochs;
}

void RequestRegistry::release_locked(const std::vector<std::uint32_t>& pages) {
  std::vector<std::uint32_t> freed;
  for (std::uint32_t page : pages) {
    if (--holders_[page] == 0) freed.push_back(page);
  }
  // A reader still holding a descriptor of these pages now fails.
  if (!freed.empty()) cache_->epochs().stamp(freed, 0);
}

bool RequestRegistry::holds(std::string_view request_id, std::string_view label) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = requests_.find(request_id);
  return r != requests_.end() && r->second.find(label) != r->second.end();
}

void RequestRegistry::remove(std::string_view request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = requests_.find(request_id);
  if (r == requests_.end()) return;
  for (const auto& [label, pub] : r->second) release_locked(pub.pages);
  requests_.erase(r);
}

void RequestRegistry::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [request, labels] : requests_) {
    for (const auto& [label, pub] : labels) release_locked(pub.pages);
  }
  requests_.clear();
}

std::size_t RequestRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t n = 0;
  for (const auto& [request, labels] : requests_) n += labels.size();
  return n;
}

}  // namespace mstar::kv
