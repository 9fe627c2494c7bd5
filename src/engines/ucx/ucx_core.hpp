// Copyright mstar-kv authors.
//
// UcxCore, the ucx engine's one owner of UCP objects (internal to the
// engine): its connections, reads and served requests, and the class.
// Members marked [progress] are used only on the progress thread. Its
// methods are defined by responsibility:
//   ucx_core.cpp     UCP set-up and release, the listener, the progress thread
//   ucx_owner.cpp    the owner's side: connections, the handshake
//   ucx_serve.cpp    the owner's side: a served read's checks, messages, verdict
//   ucx_am.cpp       active-message dispatch and the reader's data arrival
//   ucx_reader.cpp   the reader's side: connecting, peer failure, closing
//   ucx_batch.cpp    the reader's reads: am requests and gets, their bookkeeping
//   ucx_readiness.cpp layer readiness: the owner's held requests, the reader's watches
//   ucx_staging.cpp  staging (ucx_staging): both sides' messages through host buffers
//   ucx_backend.cpp  the RmaBackend / RmaPeer / RmaOperation over it, options
// The state of connections, reads and served requests is ucx_state.hpp,
// gathered messages' rows ucx_rows.hpp, the wire format ucx_wire.hpp, the handshake's cryptography
// ucx_auth.hpp, HOST:PORT ucx_address.hpp, the owners of UCP objects ucx_handles.hpp and the
// callback trampoline and request contexts' owner ucx_callback.hpp.
#pragma once

#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mstar/kv/core/epochs.hpp"
#include "rma/rma_engine.hpp"
#include "ucx_address.hpp"
#include "ucx_auth.hpp"
#include "ucx_callback.hpp"
#include "ucx_handles.hpp"
#include "ucx_rows.hpp"
#include "ucx_wire.hpp"
#include "util/auth.hpp"

#include "mstar/kv/util/thread_annotations.hpp"
#include "ucx_backend.hpp"
#include "ucx_state.hpp"

namespace mstar::kv::ucx {

class UcxCore;

// The lines a UCX dump writes (`print` gets the stream: ucp_ep_print_info,
// ucp_context_print_info), without their newlines; none if no stream opens.
// UCX 1.13 answers some questions (which transports carry an endpoint's
// lanes, whether a context has RDMA) only in these dumps.
std::vector<std::string> printed_lines(const std::function<void(FILE*)>& print);

// The remote keys of a cache of one region per layer in one backend blob
// (ucx.hpp: u32 count, then u32 length and the key's bytes each), and back:
// unpack_rkeys checks the blob as untrusted (exactly `count` keys, every
// length inside it) and throws Error(kCorruptDescriptor) naming what is
// wrong; the spans point into `blob`.
std::vector<std::uint8_t> pack_rkeys(const std::vector<std::vector<std::uint8_t>>& keys);
std::vector<std::span<const std::uint8_t>> unpack_rkeys(std::span<const std::uint8_t> blob,
                                                        std::size_t count);

// A watch on the owner's readiness of `pages` over conn (ucx_readiness.cpp).
std::unique_ptr<LayerWatch> make_ready_watch(std::shared_ptr<UcxCore> core,
                                             std::shared_ptr<Conn> conn,
                                             std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                             std::uint32_t num_layers);

struct AmTag {  // argument of the active-message handler for one id
  UcxCore* core = nullptr;
  unsigned id = 0;
};

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

class UcxCore : public std::enable_shared_from_this<UcxCore> {
 public:
  UcxCore(std::shared_ptr<KVCache> cache, const std::string& entity_id,
          const std::string& session_id, const UcxOptions& options);
  ~UcxCore();
  UcxCore(const UcxCore&) = delete;
  UcxCore& operator=(const UcxCore&) = delete;

  const rma::RmaRegionInfo& region() const noexcept { return region_; }
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

  // Runs `cmd` on the progress thread; false when the core is stopped.
  bool post(std::function<void()> cmd);
  // Closes everything, joins the progress thread, releases UCX. Idempotent.
  void stop() noexcept;

  // Caller threads.
  std::shared_ptr<Conn> connect(const rma::RmaRegionInfo& remote,
                                std::chrono::milliseconds timeout);
  // Progress thread.
  void start_batch(const std::shared_ptr<Batch>& b);
  void abort_batch(std::uint64_t id);
  // Closes both endpoints and fails the connection's reads. Gets still in
  // flight keep the rma endpoint open until they drain, unless `force`
  // (the peer is dead, the engine stops, or a drain took too long): then it
  // is closed at once and its gets are written off (see close_conn).
  void close_conn(std::shared_ptr<Conn> c, const Status& why, bool force = false);

 private:
  void init_ucp(const std::string& session_id);
  void run();
  void open_listener(const std::string& session_id);
  void drain_deferred();
  void check_drains();
  void reap_closing(bool force);

  friend struct Failing;
  // A UCX callback threw (Failing): fails read batch_id, if any.
  void callback_failed(const Failing& f, std::exception_ptr e) noexcept;
  // The bodies of the C callbacks, each called through trampoline<>.
  static void on_conn_request(ucp_conn_request_h req, void* arg);
  static void on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  static void on_client_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_length, void* data,
                            std::size_t length, const ucp_am_recv_param_t* param);
  static void on_req_done(void* request, ucs_status_t st, void* user_data);
  static void on_data_sent(void* request, ucs_status_t st, void* user_data);
  static void on_recv_done(void* request, ucs_status_t st, std::size_t length, void* user_data);
  static void on_control_sent(void* request, ucs_status_t st, void* user_data);
  static void on_data_ep_flushed(void* request, ucs_status_t st, void* user_data);

  ucs_status_t handle_am(unsigned id, const void* header, std::size_t header_length, void* data,
                         std::size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t handle_data(const DataHdr& h, void* data, std::size_t length,
                           const ucp_am_recv_param_t* param);
  ucs_status_t handle_gather(const GatherHdr& h, void* data, std::size_t length, bool rndv);
  // Receives a rendezvous into `buffer` (count bytes, or count iov entries
  // when ctx->iov is set) for batch b, which then waits for it.
  ucs_status_t post_recv(const std::shared_ptr<Batch>& b, void* data, void* buffer,
                         std::size_t count, ReqCtx* ctx);
  // Owner: posts the queue's next replies, up to kSendWindow in flight; one
  // span, or a group of spans as one gathered message (kReqGather).
  void pump(const std::shared_ptr<SendQueue>& q);
  bool send_span(const std::shared_ptr<SendQueue>& q, const CopySpan& s);
  bool send_gathered(const std::shared_ptr<SendQueue>& q, std::size_t first, std::size_t count);
  bool posted(const std::shared_ptr<SendQueue>& q, SendCtx* ctx, ucs_status_ptr_t sp);
  // The handshake (ucx_wire.hpp): owner and reader halves.
  void on_hello(const Served& to, const HelloHdr& h);
  void on_auth(const Served& to, const AuthHdr& h);
  void on_challenge(const ChallengeHdr& h);
  void serve_hello(const Served& to, std::uint64_t conn_id);
  void refuse_hello(const Served& to, std::uint64_t conn_id, const std::string& why);
  // True when a request carrying `ticket` may be served (always without a
  // token on this owner).
  bool ticket_valid(std::uint64_t ticket) const {
    return options_.auth_token.empty() || (ticket != 0 && tickets_.count(ticket) != 0);
  }
  // The record a request that arrived on `reply_ep` carrying `ticket` is
  // answered through (ServedEp): a listener endpoint's own, or for an
  // endpoint UCX made (a reader's data endpoint) a record that answers for
  // the connection holding the ticket; null when no connection holds it.
  // Called in the active-message handler, while reply_ep is valid.
  Served served_of(ucp_ep_h reply_ep, std::uint64_t ticket);
  // Sends a small reply on `to`, or, its endpoint gone, drops it (drop()).
  void reply(const Served& to, unsigned id, const void* header, std::size_t header_len,
             const void* data, std::size_t data_len);
  // `n` replies (or verdicts) for a reader whose endpoint is gone were not
  // sent: counted, and logged the first time.
  void drop(std::uint64_t n, const char* what);
  // Runs `fn` after this progress round (or, held by the test seam
  // test_hold, once it is let go).
  void later(std::function<void()> fn) { (hold_ ? held_ : deferred_).push_back(std::move(fn)); }
  // A kReqStrided request: validates every span against the region, then
  // serves it as serve_read does, gathering each message's rows from the
  // spans as it goes.
  void serve_strided(const Served& to, const ReadReqHdr& h, const std::vector<WireStrided>& spans,
                     std::vector<std::uint32_t> pages);
  // A cache of one region per layer: bytes [first, last] of a served span
  // lie in one layer (always true for one region).
  bool within_one_layer(std::uint64_t first, std::uint64_t last) const noexcept {
    return layer_bytes_ == 0 || first / layer_bytes_ == last / layer_bytes_;
  }
  Status crosses_layers(const char* what, std::size_t i, std::uint64_t first,
                        std::uint64_t last) const;
  // Serves a read's spans (checked against the region here), or its strided
  // spans (checked by serve_strided; spans is then empty).
  void serve_read(const Served& to, const ReadReqHdr& h, std::vector<CopySpan> spans,
                  std::vector<StridedSpan> strided, std::vector<std::uint32_t> pages);
  // Every send of q completed (or failed): the verdict, and q counted.
  void serve_done(const std::shared_ptr<SendQueue>& q);
  Status check_served_epochs(std::uint64_t epoch, const std::vector<std::uint32_t>& pages,
                             const char* when) const;
  void send_epoch_check(const std::shared_ptr<Batch>& b);

  // Staging (ucx_staging.cpp), when copier_ is set. Owner: gives q a
  // pipeline that gathers each of its messages into a host buffer (false,
  // the read refused, when it cannot be made); sends a gathered message.
  bool stage_sends(const std::shared_ptr<SendQueue>& q);
  bool send_staged(const std::shared_ptr<SendQueue>& q, const staging::GatherPipeline::Ready& r);
  // Reader: gives b a pipeline that receives its gathered replies into host
  // buffers and scatters them; a reply's arrival (after handle_gather's
  // checks); its bytes into a buffer; a rendezvous into a buffer completed.
  void stage_reads(const std::shared_ptr<Batch>& b);
  ucs_status_t staged_arrival(const std::shared_ptr<Batch>& b, const GatherHdr& h, void* data,
                              std::size_t length, bool rndv);
  void land_staged(const std::shared_ptr<Batch>& b, std::size_t message, staging::Buffer& into,
                   void* data, std::size_t length, bool rndv);
  void staged_received(std::uint64_t batch_id, std::size_t message, ucs_status_t st);
  // Releases what a stopped read holds (its waiting rendezvous); true once
  // no copy of it runs any more.
  bool staged_idle(Batch& b);
  // Every progress round while any is pending: owners' gathers and
  // readers' scatters.
  void poll_staged();
  std::shared_ptr<staging::Copier> copier_;               // null: no staging
  std::vector<std::shared_ptr<SendQueue>> staged_waits_;  // [progress] owner: a gather to finish
  std::set<std::uint64_t> staged_reads_;                  // [progress] reader: reads with copies

 public:
  // Done notices (leases): reader and owner halves.
  void send_done(const std::shared_ptr<Conn>& c, std::uint64_t seq_id, std::uint64_t epoch) {
    const DoneHdr hdr{seq_id, epoch, c->served.generation, c->ticket};
    send_small(c->ep.get(), kAmDone, &hdr, sizeof hdr, nullptr, 0, true);
  }
  void set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> h) {
    std::lock_guard<std::mutex> lk(done_mu_);
    done_handler_ = std::move(h);
  }
  // Layer readiness (ucx_readiness.cpp). Reader: asks the owner for the
  // next notice of watch w (progress thread), forgets a watch.
  void send_ready_req(const std::shared_ptr<ReadyWatch>& w);
  void forget_watch(std::uint64_t id) { watches_.erase(id); }
  std::atomic<std::uint64_t> next_watch{1};  // watch ids, unique per core

 private:
  std::mutex done_mu_;
  std::function<void(std::uint64_t, std::uint64_t)> done_handler_ MSTAR_KV_GUARDED_BY(done_mu_);
  // Layer readiness, owner: answers or holds a request; re-checks the
  // held ones (every progress round while any is held). Reader: a notice.
  void on_ready_req(const Served& to, const ReadyReqHdr& h, std::vector<std::uint32_t> pages);
  bool answer_ready(const ReadyHold& r, bool expired);
  void check_ready_holds();
  void on_ready_notice(const ReadyHdr& h, std::string message);
  std::unordered_map<std::uint64_t, std::shared_ptr<ReadyWatch>> watches_;  // [progress]
  std::vector<ReadyHold> ready_holds_;                                      // [progress]

  void on_fin(const std::shared_ptr<Batch>& b, const Status& st);
  // Refuses read batch_id (counted as refused).
  void send_err(const Served& to, std::uint64_t batch_id, const Status& st);
  void hello_reply(const HelloHdr& h, const std::vector<std::uint8_t>& bytes);
  void request_finished(std::uint64_t batch_id, ucs_status_t st);
  void post_gets(const std::shared_ptr<Batch>& b);
  // The context of a request that writes locally for read batch_id.
  ReqCtx* new_ctx(std::uint64_t batch_id) {
    auto c = std::make_unique<ReqCtx>();
    c->core = this;
    c->batch_id = batch_id;
    return reads_.add(std::move(c));
  }
  void maybe_finish(std::shared_ptr<Batch> b);
  void fail_batch(std::shared_ptr<Batch> b, Status st);
  struct EpInfo {
    bool nic_rma = false;  // an RMA lane on an RDMA transport
    bool shm_am = false;   // an active-message lane on shared memory
  };
  EpInfo inspect_ep(ucp_ep_h ep);
  void data_ep_ready(std::uint64_t conn_id, ucs_status_t st);
  void close_server_ep(ucp_ep_h ep);
  // Closes `ep` by force; `rkeys` and `keep` (the error handler's argument)
  // live until the close completes.
  void close_ep(Endpoint ep, std::vector<RemoteKey> rkeys, std::shared_ptr<Conn> keep);
  // Sends a small message whose header and data are copied into a block
  // that lives until the send completes.
  void send_small(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_len,
                  const void* data, std::size_t data_len, bool reply);

  const std::shared_ptr<KVCache> cache_;
  const UcxOptions options_;
  // In creation order: destroyed in reverse (ucx_handles.hpp).
  Context context_;
  Worker worker_;
  std::vector<MemReg> memhs_;      // one per region (regions.hpp)
  std::uint64_t layer_bytes_ = 0;  // a cache of one region per layer: each region's bytes

 public:
  // The registration holding the byte at layout offset `offset`.
  ucp_mem_h memh_at(std::uint64_t offset) const noexcept {
    return layer_bytes_ == 0 ? memhs_.front().get() : memhs_[offset / layer_bytes_].get();
  }
  const KVLayout& local_layout() const noexcept { return cache_->layout(); }

 private:
  RowDatatype rows_dt_;  // strided spans' rows, packed from the pages (ucx_rows.hpp)
  RowDatatype sink_dt_;  // gathered replies, unpacked into the pages
  Listener listener_;
  int efd_ = -1;
  rma::RmaRegionInfo region_;
  std::vector<std::uint8_t> worker_address_;  // sent in the hello reply
  AmTag am_tags_[kAmMaxId + 1];

  std::mutex mu_;
  std::deque<std::function<void()>> commands_ MSTAR_KV_GUARDED_BY(mu_);
  bool stopped_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::atomic<bool> stop_requested_{false};
  std::mutex stop_mu_;
  std::thread thread_;

  // [progress]
  std::vector<std::function<void()>> deferred_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Conn>> conns_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Batch>> batches_;
  // The owner's listener endpoints (one per reader connection), each with
  // the record its replies hold (ServedEp), and the connections by ticket.
  struct Listened {
    Endpoint owned;
    Served served;
  };
  std::unordered_map<ucp_ep_h, Listened> server_eps_;
  std::unordered_map<std::uint64_t, Served> tickets_;
  bool hold_ = false;                        // [progress] test seam (test_hold)
  std::vector<std::function<void()>> held_;  // [progress] what later() held
  // The user_data of requests in flight: gets and receives, data replies,
  // control messages. What UCX never completes (written off, see
  // close_conn) is destroyed by stop(), after the worker.
  InFlight<ReqCtx> reads_;
  InFlight<SendCtx> sends_;
  InFlight<Control> controls_;
  std::set<std::uint64_t> draining_;  // aborted get batches waiting to drain
  struct Closing {                    // an endpoint's close in flight
    std::vector<RemoteKey> rkeys;     // destroyed after the request is freed
    Request request;
    std::shared_ptr<Conn> conn;  // keeps the error-handler argument alive
  };
  std::vector<Closing> closing_;
  std::uint64_t next_conn_ = 1;

 public:
  std::atomic<std::uint64_t> next_batch{1};  // batch ids, unique per core

  // What this owner served (stats.hpp, ServedStats): any thread may read.
  ServedStats served_stats() const noexcept;
  // Test seam (tests/engines/ucx/ucx_owner_lifetime_test.cpp): with `on`,
  // an owner's continuations after a data reply completed (its next
  // replies, its verdict) wait until test_hold(false) lets them go, so that
  // a test can close the reader's connection in between, every time. Runs
  // on the progress thread; false when the core is stopped.
  bool test_hold(bool on) {
    return post([this, on] {
      hold_ = on;
      if (on) return;
      for (auto& fn : held_) deferred_.push_back(std::move(fn));
      held_.clear();
    });
  }

 private:
  struct Counters {
    std::atomic<std::uint64_t> reads{0}, bytes{0}, refused{0}, dropped{0}, connected{0}, gone{0},
        staged{0};
  };
  Counters counters_;
  std::atomic<bool> drop_logged_{false};
};

}  // namespace mstar::kv::ucx
