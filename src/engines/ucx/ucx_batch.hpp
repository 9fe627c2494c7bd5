// Copyright mstar-kv authors.
//
// UcxReads, the reader's reads (internal to the ucx engine): starting one
// (an am request or gets), its data's arrival, its requests' completions,
// the epoch checks, failing, aborting and finishing it. It owns the reads
// in flight (Batch, by id) and the aborted ones whose gets still drain.
// Threads: made and cleared (clear()) by UcxCore while no progress thread
// runs; next_batch from any thread; the rest on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>

#include "ucx_backend.hpp"
#include "ucx_part.hpp"
#include "ucx_state.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

class UcxReads : private UcxPart {
 public:
  explicit UcxReads(UcxCore& core);

  std::atomic<std::uint64_t> next_batch{1};  // batch ids, unique per core
  void start_batch(const std::shared_ptr<Batch>& b);
  void abort_batch(std::uint64_t id);
  // The read `batch_id` while it is in flight, else null.
  std::shared_ptr<Batch> find(std::uint64_t batch_id) const;
  bool empty() const noexcept { return batches_.empty(); }
  bool draining() const noexcept { return !draining_.empty(); }
  // An active message for a read (kAmReadData, kAmGatherData, kAmReadErr,
  // kAmReadFin), in UCX's handler.
  ucs_status_t handle_am(unsigned id, const void* header, std::size_t header_length, void* data,
                         std::size_t length, const ucp_am_recv_param_t* param);
  void fail_batch(std::shared_ptr<Batch> b, Status st);
  void maybe_finish(std::shared_ptr<Batch> b);
  // The context of a request that writes locally for read batch_id.
  ReqCtx* new_ctx(std::uint64_t batch_id);
  // Every progress round while any is draining: closes by force the
  // connection of a read whose gets did not drain in kDrainGrace.
  void check_drains();
  // After the loop: fails the reads UCX did not complete (nothing can land
  // any more); then, after the progress thread ended, drops them.
  void abandon();
  void clear() noexcept { batches_.clear(); }
  // The bodies of the C callbacks, each called through trampoline<>.
  static void on_req_done(void* request, ucs_status_t st, void* user_data);
  static void on_recv_done(void* request, ucs_status_t st, std::size_t length, void* user_data);

 private:
  ucs_status_t handle_data(const DataHdr& h, void* data, std::size_t length,
                           const ucp_am_recv_param_t* param);
  ucs_status_t handle_gather(const GatherHdr& h, void* data, std::size_t length, bool rndv);
  // Receives a rendezvous into `buffer` (count bytes, or count iov entries
  // when ctx->iov is set) for batch b, which then waits for it.
  ucs_status_t post_recv(const std::shared_ptr<Batch>& b, void* data, void* buffer,
                         std::size_t count, ReqCtx* ctx);
  void on_fin(const std::shared_ptr<Batch>& b, const Status& st);
  void send_epoch_check(const std::shared_ptr<Batch>& b);
  void request_finished(std::uint64_t batch_id, ucs_status_t st);
  void post_gets(const std::shared_ptr<Batch>& b);

  std::unordered_map<std::uint64_t, std::shared_ptr<Batch>> batches_;  // [progress]
  std::set<std::uint64_t> draining_;  // [progress] aborted get batches waiting to drain
};

}  // namespace mstar::kv::ucx
