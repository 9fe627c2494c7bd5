// Copyright mstar-kv authors.
//
// UcxCore: making its parts, stopping them, the progress loop's rounds and
// callbacks that threw (ucx_core.hpp).
#include "ucx_core.hpp"

#include <cstring>

namespace mstar::kv::ucx {

UcxCore::UcxCore(std::shared_ptr<KVCache> cache, const std::string& entity_id,
                 const std::string& session_id, const UcxOptions& options)
    : cache_(std::move(cache)),
      options_(options),
      staging_(*this, cache_, options_),
      worker_(*this, cache_, entity_id, options_),
      owner_(*this, session_id),
      serving_(*this),
      reader_(*this),
      reads_(*this),
      progress_(worker_, *this, options_.progress) {}

UcxCore::~UcxCore() { stop(); }

void UcxCore::stop() noexcept {
  std::lock_guard<std::mutex> lk(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  progress_.stop();
  worker_.reap_closing(true);
  reader_.clear();
  reads_.clear();
  owner_.clear();
  worker_.release();
}

void UcxCore::after_round() {
  worker_.reap_closing(false);
  if (reads_.draining()) reads_.check_drains();
  if (!reads_.empty()) reader_.check_peers();
  if (staging_.pending()) staging_.poll();
  if (owner_.holding()) owner_.check_ready_holds();
}

void UcxCore::close_all() {
  reader_.close_all();
  owner_.close_all();
}

bool UcxCore::settled() const { return !worker_.closing() && reads_.empty(); }

ProgressRounds::Activity UcxCore::activity() const {
  Activity a;
  a.busy = !reads_.empty() || worker_.sending() || staging_.gathering();
  a.holding = owner_.holding();
  a.draining = reads_.draining();
  return a;
}

void UcxCore::abandon() { reads_.abandon(); }

void Failing::failed(std::exception_ptr e) const noexcept { core->callback_failed(*this, e); }

AmGuard::AmGuard(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
                 const ucp_am_recv_param_t*) noexcept
    : Failing{static_cast<AmTag*>(arg)->core, 0, "an active message"} {
  // Replies to this core's reads: their headers start with its batch id.
  const unsigned id = static_cast<AmTag*>(arg)->id;
  if ((id == kAmReadData || id == kAmGatherData || id == kAmReadErr || id == kAmReadFin) &&
      header_length >= sizeof batch_id) {
    std::memcpy(&batch_id, header, sizeof batch_id);
  }
}

void UcxCore::callback_failed(const Failing& f, std::exception_ptr e) noexcept {
  std::string why = "unknown exception";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    why = ex.what();
  } catch (...) {
  }
  try {
    const std::shared_ptr<Batch> b = f.batch_id != 0 ? reads_.find(f.batch_id) : nullptr;
    if (b) {
      reads_.fail_batch(
          b, Status(StatusCode::kInternal,
                    std::string("the ucx engine failed handling ") + f.what + ": " + why));
      return;
    }
  } catch (...) {
  }
  // Nothing of ours to fail (the owner's side, a handshake): the peer's
  // read or connect fails in its timeout.
  std::fprintf(stderr, "mstar-kv ucx: handling %s failed: %s\n", f.what, why.c_str());
}

}  // namespace mstar::kv::ucx
