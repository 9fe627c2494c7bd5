// Copyright mstar-kv authors.
#include "shm_readiness.hpp"

#include <chrono>
#include <string>
#include <utility>

namespace mstar::kv::shm {

namespace {

class ShmLayerWatch final : public LayerWatch {
 public:
  ShmLayerWatch(std::shared_ptr<const ShmMapping> m, std::vector<std::uint32_t> pages,
                std::uint64_t epoch)
      : mapping_(std::move(m)), pages_(std::move(pages)), epoch_(epoch) {}

  Status poll(std::uint32_t* layers_ready) override {
    const std::uint32_t num_layers = mapping_->info().layout.num_layers;
    std::uint32_t r = 0;
    Status s = check_layer_readiness(mapping_->ready_words(), mapping_->epochs(),
                                     mapping_->epoch_pages(), pages_, epoch_, num_layers,
                                     floor_, &r);
    if (!s.is_ok()) return s;
    floor_ = r;
    // Layers still missing: an owner that died will never mark them. The
    // check costs two syscalls, so at most once per millisecond.
    if (r < num_layers) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_owner_check_) {
        next_owner_check_ = now + std::chrono::milliseconds(1);
        Status alive = mapping_->check_owner();
        if (!alive.is_ok()) {
          return {alive.code(), alive.message() + " with " + std::to_string(r) + " of " +
                                    std::to_string(num_layers) + " layers marked ready"};
        }
      }
    }
    *layers_ready = r;
    return Status::ok();
  }

 private:
  std::shared_ptr<const ShmMapping> mapping_;
  std::vector<std::uint32_t> pages_;
  std::uint64_t epoch_;
  std::uint32_t floor_ = 0;
  std::chrono::steady_clock::time_point next_owner_check_{};
};

}  // namespace

std::unique_ptr<LayerWatch> make_layer_watch(std::shared_ptr<const ShmMapping> mapping,
                                             std::vector<std::uint32_t> pages,
                                             std::uint64_t epoch) {
  return std::make_unique<ShmLayerWatch>(std::move(mapping), std::move(pages), epoch);
}

}  // namespace mstar::kv::shm
