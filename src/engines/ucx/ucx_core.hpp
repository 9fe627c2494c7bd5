// Copyright mstar-kv authors.
//
// UcxCore, the ucx engine's one owner of UCP objects (internal to the
// engine): a composition of the engine's parts, each with its own header
// and contract, made in this order and stopped in reverse:
//   UcxStaging     ucx_staging.hpp   the copier of a staged cache, what waits on a copy
//   UcxWorker      ucx_worker.hpp    UCP context and worker, registrations, the region,
//                                    request contexts, control messages, endpoint closes
//   UcxOwner       ucx_owner.hpp     the listener, readers' connections, the handshake's
//                                    owner half, held readiness requests, what it served
//   UcxServedReads ucx_serve.hpp     the owner's served reads: checks, replies, verdicts
//   UcxReader      ucx_reader.hpp    connections to owners, peer failure, layer watches
//   UcxReads       ucx_batch.hpp     the reader's reads: am requests and gets, arrival
//   UcxProgress    ucx_progress.hpp  the progress thread and its work queue
// Members marked [progress] are used only on the progress thread. Where
// the methods are defined:
//   ucx_core.cpp      UcxCore: making, stopping, the progress loop's rounds
//   ucx_worker.cpp    UCP set-up and release, control messages, closing endpoints
//   ucx_progress.cpp  the progress loop
//   ucx_owner.cpp     the owner's side: connections, the handshake
//   ucx_serve.cpp     the owner's side: a served read's checks, messages, verdict
//   ucx_am.cpp        active-message dispatch, the sides' handlers, the reader's data arrival
//   ucx_reader.cpp    the reader's side: connecting, peer failure, closing
//   ucx_batch.cpp     the reader's reads: am requests and gets, their bookkeeping
//   ucx_readiness.cpp layer readiness: the owner's held requests, the reader's watches
//   ucx_staging.cpp   staging (ucx_staging): both sides' messages through host buffers
//   ucx_backend.cpp   the RmaBackend / RmaPeer / RmaOperation over it, options
// The state of connections, reads and served requests is ucx_state.hpp,
// gathered messages' rows ucx_rows.hpp, the wire format ucx_wire.hpp, the handshake's cryptography
// ucx_auth.hpp, HOST:PORT ucx_address.hpp, the owners of UCP objects ucx_handles.hpp and the
// callback trampoline and request contexts' owner ucx_callback.hpp.
#pragma once

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mstar/kv/core/epochs.hpp"
#include "rma/rma_engine.hpp"
#include "ucx_address.hpp"
#include "ucx_auth.hpp"
#include "ucx_batch.hpp"
#include "ucx_callback.hpp"
#include "ucx_handles.hpp"
#include "ucx_owner.hpp"
#include "ucx_progress.hpp"
#include "ucx_reader.hpp"
#include "ucx_rows.hpp"
#include "ucx_serve.hpp"
#include "ucx_staging.hpp"
#include "ucx_wire.hpp"
#include "ucx_worker.hpp"
#include "util/auth.hpp"

#include "mstar/kv/util/thread_annotations.hpp"
#include "ucx_backend.hpp"
#include "ucx_state.hpp"

namespace mstar::kv::ucx {

class UcxCore;

// A watch on the owner's readiness of `pages` over conn (ucx_readiness.cpp).
std::unique_ptr<LayerWatch> make_ready_watch(std::shared_ptr<UcxCore> core,
                                             std::shared_ptr<Conn> conn,
                                             std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                             std::uint32_t num_layers);

// The guards of trampoline<> (ucx_callback.hpp): what a callback that
// threw fails, read from its arguments before it runs.
struct Failing {
  UcxCore* core = nullptr;
  std::uint64_t batch_id = 0;  // a read of this core, or 0: nothing to fail
  const char* what = "";
  void failed(std::exception_ptr e) const noexcept;
};
struct RequestGuard : Failing {  // user_data is a Pending
  RequestGuard(void*, ucs_status_t, void* ud) noexcept
      : Failing{static_cast<Pending*>(ud)->core, static_cast<Pending*>(ud)->batch_id,
                "a request's completion"} {}
  RequestGuard(void* r, ucs_status_t st, std::size_t, void* ud) noexcept
      : RequestGuard(r, st, ud) {}
};
struct AmGuard : Failing {  // arg is an AmTag; reader-side headers name a batch
  AmGuard(void* arg, const void* header, std::size_t header_length, void*, std::size_t,
          const ucp_am_recv_param_t*) noexcept;
};
struct ConnGuard : Failing {  // arg is a Conn
  ConnGuard(void* arg, ucp_ep_h, ucs_status_t) noexcept
      : Failing{static_cast<Conn*>(arg)->core, 0, "a peer failure"} {}
};
struct CoreGuard : Failing {  // arg is the UcxCore
  CoreGuard(void* arg, ucp_ep_h, ucs_status_t) noexcept
      : Failing{static_cast<UcxCore*>(arg), 0, "a reader's failure"} {}
  CoreGuard(ucp_conn_request_h, void* arg) noexcept
      : Failing{static_cast<UcxCore*>(arg), 0, "a connection request"} {}
};

// Threads: made and stopped on a caller's thread; post(), stop() and the
// const accessors from any thread (stop() not from the progress thread);
// what its parts do runs where their headers say.
class UcxCore : public std::enable_shared_from_this<UcxCore>, private ProgressRounds {
 public:
  // Throws what its parts throw (see UcxBackend's constructor).
  UcxCore(std::shared_ptr<KVCache> cache, const std::string& entity_id,
          const std::string& session_id, const UcxOptions& options);
  ~UcxCore() override;
  UcxCore(const UcxCore&) = delete;
  UcxCore& operator=(const UcxCore&) = delete;

  const rma::RmaRegionInfo& region() const noexcept { return worker_.region(); }
  const UcxOptions& options() const noexcept { return options_; }
  // One step of a read, at debug level (MSTAR_KV_LOG=debug), stamped with
  // CLOCK_MONOTONIC seconds so an owner's and a reader's lines on one host
  // interleave: where a slow read's time went.
  template <class... A>
  void trace(const char* fmt, A... a) const noexcept {
    if (!options_.log.enabled(LogLevel::kDebug)) return;
    char line[320];
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    const int n = std::snprintf(line, sizeof line, "ucx t=%.6f ", now);
    std::snprintf(line + n, sizeof line - static_cast<std::size_t>(n), fmt, a...);
    options_.log.debug(line);
  }

  const std::shared_ptr<KVCache>& cache() const noexcept { return cache_; }
  const KVLayout& local_layout() const noexcept { return cache_->layout(); }
  // Runs `cmd` on the progress thread; false when the core is stopped.
  bool post(std::function<void()> cmd) { return progress_.post(std::move(cmd)); }
  // Closes everything, joins the progress thread, releases UCX. Idempotent.
  void stop() noexcept;

  // The parts (see the file comment).
  UcxStaging& staging() noexcept { return staging_; }
  UcxWorker& worker() noexcept { return worker_; }
  UcxOwner& owner() noexcept { return owner_; }
  UcxServedReads& serving() noexcept { return serving_; }
  UcxReader& reader() noexcept { return reader_; }
  UcxReads& reads() noexcept { return reads_; }
  UcxProgress& progress() noexcept { return progress_; }

  // The body of the active-message handler (through trampoline<>): hands a
  // message to the side its id is for.
  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_length, void* data,
                            std::size_t length, const ucp_am_recv_param_t* param);

 private:
  friend struct Failing;
  // A UCX callback threw (Failing): fails read batch_id, if any.
  void callback_failed(const Failing& f, std::exception_ptr e) noexcept;
  // ProgressRounds, on the progress thread.
  void after_round() override;
  void close_all() override;
  bool settled() const override;
  Activity activity() const override;
  void abandon() override;

  const std::shared_ptr<KVCache> cache_;
  const UcxOptions options_;
  std::mutex stop_mu_;
  bool stopped_ MSTAR_KV_GUARDED_BY(stop_mu_) = false;
  UcxStaging staging_;
  UcxWorker worker_;
  UcxOwner owner_;
  UcxServedReads serving_;
  UcxReader reader_;
  UcxReads reads_;
  UcxProgress progress_;  // last: its thread starts once every part is made
};

}  // namespace mstar::kv::ucx
