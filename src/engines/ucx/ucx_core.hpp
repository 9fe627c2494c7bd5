// Copyright mstar-kv authors.
//
// UcxCore, the ucx engine's one owner of UCP objects (internal to the
// engine): its connections, reads and served requests, and the class.
// Members marked [progress] are used only on the progress thread. Its
// methods are defined by responsibility:
//   ucx_core.cpp     UCP set-up and release, the listener, the progress thread
//   ucx_owner.cpp    the owner's side: connections, the handshake, served reads
//   ucx_am.cpp       active-message dispatch and the reader's data arrival
//   ucx_reader.cpp   the reader's side: connecting, peer failure, closing
//   ucx_batch.cpp    the reader's reads: am requests and gets, their bookkeeping
//   ucx_readiness.cpp layer readiness: the owner's held requests, the reader's watches
//   ucx_backend.cpp  the RmaBackend / RmaPeer / RmaOperation over it, options
// The wire format is ucx_wire.hpp, the handshake's cryptography ucx_auth.hpp,
// HOST:PORT ucx_address.hpp, the owners of UCP objects ucx_handles.hpp and
// the callback trampoline and request contexts' owner ucx_callback.hpp.
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

#include "core/auth.hpp"
#include "mstar/kv/epochs.hpp"
#include "engines/rma/rma_engine.hpp"
#include "ucx_address.hpp"
#include "ucx_auth.hpp"
#include "ucx_callback.hpp"
#include "ucx_handles.hpp"
#include "ucx_rows.hpp"
#include "ucx_wire.hpp"

#include "ucx_backend.hpp"
#include "mstar/kv/thread_annotations.hpp"

namespace mstar::kv::ucx {

constexpr std::uint64_t kMaxSpansPerRequest = 1u << 22;
// A read gathers (kReqGather) when it has at least this many spans of on
// average fewer bytes than this: the owner then sends groups of spans as
// messages of up to 1 MiB (kGatherBytes). Over tcp with 64 KiB segments a
// group beat one message per span at every size up to 128 KiB (64 KiB x 128:
// 3.2 -> 4.0-4.6 GB/s, 4 KiB x 4096: 1.8 -> 3.8).
constexpr std::size_t kGatherMinSpans = 64;
constexpr std::uint64_t kGatherBelowBytes = 256u << 10;
// Gathered reads of at least this many bytes land with non-temporal stores
// (RowSink): far more than the caches keep.
constexpr std::uint64_t kStreamGatheredBytes = 16u << 20;

// Whether a read of these spans gets gathered replies (kReqGather): many,
// and small on average.
inline bool gathers(const std::vector<CopySpan>& spans) {
  if (spans.size() < kGatherMinSpans) return false;
  std::uint64_t total = 0;
  for (const CopySpan& s : spans) total += s.length;
  return total / spans.size() < kGatherBelowBytes;
}
// Gets in flight per read. Small enough that an aborted read drains in
// microseconds on shared memory, large enough to keep a NIC busy.
constexpr std::size_t kGetWindow = 16;
// How long an aborted read's gets may take to drain before the connection
// is closed by force.
constexpr std::chrono::milliseconds kDrainGrace{250};

inline std::string ucs_str(ucs_status_t st) { return ucs_status_string(st); }

// ---------------------------------------------------------------------------
// UcxCore: everything that touches UCP. Members marked [progress] are used
// only on the progress thread.
// ---------------------------------------------------------------------------

class UcxCore;

struct Conn {
  UcxCore* core = nullptr;
  std::uint64_t id = 0;
  std::string session_id;
  Endpoint ep;                       // [progress] client/server: control, am reads
  // [progress] to the owner's worker address, where UCX may use shared
  // memory or RDMA: gets, or am reads when its am lane is shared memory.
  Endpoint data_ep;
  RemoteKey rkey;                    // [progress] unpacked on data_ep (get)
  bool am_on_data = false;           // am reads go over data_ep, not ep
  bool closing = false;              // [progress]
  bool hello_set = false;            // [progress]
  std::set<std::uint64_t> batches;   // [progress]
  std::atomic<bool> failed{false};
  // [progress] The handshake (ucx_auth.hpp): this reader's nonce, whether
  // the owner proved the secret, and the ticket its requests carry.
  Nonce nonce_r{};
  bool owner_proved = false;
  std::uint64_t ticket = 0;
  // Written on the progress thread before `hello` is set; read by others
  // only after hello's future is ready (the promise orders them).
  Mode mode = Mode::kAm;
  rma::RmaRegionInfo served;
  std::promise<Status> hello;
};

struct Batch {
  std::uint64_t id = 0;
  std::shared_ptr<Conn> conn;
  rma::RmaCompletion done;
  std::vector<rma::RmaRead> chunks;
  std::unordered_map<std::uint64_t, std::uint64_t> pending;  // am: local off -> len
  std::size_t outstanding = 0;  // UCX requests that may still write locally
  std::size_t next_chunk = 0;   // get: chunks[next_chunk..] not posted yet
  bool get = false;
  std::chrono::steady_clock::time_point drain_deadline{};
  bool aborted = false;
  std::optional<Status> failure;
  // Page epochs: am reads wait for the owner's kAmReadFin; get reads ask
  // the owner before (phase 0) and after (phase 2) the gets (phase 1).
  rma::RmaEpochCheck check;
  bool fin = false;
  int get_phase = 1;
  // kReqGather: the owner sends groups of units (chunks, or with
  // kReqStrided whole strided spans); got[i] marks unit i landed (each
  // exactly once), got_count how many did.
  bool gather = false;
  std::vector<std::uint8_t> got;
  std::size_t got_count = 0;
  // kReqStrided: the spans as planned, never expanded into rows (chunks is
  // empty; over gets they become rows in start_batch).
  std::vector<StridedSpan> strided;
  std::size_t units() const noexcept { return strided.empty() ? chunks.size() : strided.size(); }
  // A large gathered read: its rows are written with non-temporal stores.
  bool stream = false;
};

// The user_data of a UCX request, owned by an InFlight<> of the core from
// posting until the request's callback (ucx_callback.hpp).
struct Pending {
  UcxCore* core = nullptr;
  std::uint64_t batch_id = 0;  // the read of this core it writes for, or 0
};

// What a request's user_data (posted as a Pending*) points at.
template <class T>
T* context_of(void* user_data) noexcept {
  return static_cast<T*>(static_cast<Pending*>(user_data));
}

struct ReqCtx : Pending {  // a get or a rendezvous receive into local pages
  std::vector<StridedSpan> spans;  // a gathered rendezvous: its spans (local side)
  RowSink sink;                    // a gathered rendezvous: where its rows land
  bool gathered = false;
};

// One served read whose pages are checked once every send completed.
struct ServeState {
  ucp_ep_h ep = nullptr;
  std::uint64_t batch_id = 0;
  std::uint64_t epoch = 0;
  std::vector<std::uint32_t> pages;
  std::size_t left = 0;  // sends not completed, plus one while posting
  bool failed = false;
};

// One served read's replies not yet posted: the owner keeps at most
// kSendWindow of them in flight per read and posts the next as each
// completes. UCX over tcp slows down with thousands of outstanding sends:
// 64 KiB x 4096 ran at 1.55 GB/s with every reply posted at once, 2.7-2.8
// with 16-64 in flight, 2.1 with 256 (bench/README.md, "UCX send window").
struct SendQueue {
  ucp_ep_h ep = nullptr;
  std::uint64_t batch_id = 0;
  std::uint64_t flags = 0;
  std::vector<CopySpan> spans;  // rows checked against the region
  // kReqStrided: the strided spans instead (checked, never expanded).
  std::vector<StridedSpan> strided;
  // kReqGather: groups of spans (or strided spans) [first, first + count),
  // one message each.
  std::vector<std::pair<std::size_t, std::size_t>> groups;
  std::shared_ptr<ServeState> serve;  // null when no epoch is checked
  std::size_t next = 0;       // the next span (or group) to post
  std::size_t in_flight = 0;  // posted, not completed
  bool done_posting = false;
  std::size_t total() const noexcept { return groups.empty() ? spans.size() : groups.size(); }
};
inline constexpr std::size_t kSendWindow = 32;

struct SendCtx : Pending {  // a data reply (its header must outlive the send)
  DataHdr hdr{};
  std::shared_ptr<SendQueue> queue;   // the read it belongs to
  std::shared_ptr<ServeState> serve;  // null when no epoch is checked
  GatherHdr gather{};                 // gathered replies (kReqGather)
  std::vector<ucp_dt_iov_t> iov;      // their spans in the registered pages
  RowSource rows;                     // or, kReqStrided, their strided spans' rows
};

// A control message's bytes (header then data), or the wireup flush of
// connection conn_id's data endpoint.
struct Control : Pending {
  std::vector<std::uint8_t> bytes;
  std::uint64_t conn_id = 0;
};

// The reader's half of one layer watch (ucx_readiness.cpp), shared by the
// watch (stream driver's thread) and the progress thread.
struct ReadyWatch {
  std::uint64_t id = 0;
  std::shared_ptr<Conn> conn;
  std::vector<std::uint32_t> pages;
  std::uint64_t epoch = 0;
  std::uint32_t num_layers = 0;
  std::mutex mu;
  std::uint32_t layers MSTAR_KV_GUARDED_BY(mu) = 0;      // the last notice's count
  bool outstanding MSTAR_KV_GUARDED_BY(mu) = false;      // a request awaits its notice
  std::optional<Status> error MSTAR_KV_GUARDED_BY(mu);   // the watch failed
};

// The owner's half: a request held until its count moves (ucx_readiness.cpp).
struct ReadyHold {
  ucp_ep_h ep = nullptr;
  ReadyReqHdr hdr{};
  std::vector<std::uint32_t> pages;
  std::chrono::steady_clock::time_point until;
};

class UcxCore;
// A watch on the owner's readiness of `pages` over conn (ucx_readiness.cpp).
std::unique_ptr<LayerWatch> make_ready_watch(std::shared_ptr<UcxCore> core,
                                             std::shared_ptr<Conn> conn,
                                             std::vector<std::uint32_t> pages,
                                             std::uint64_t epoch, std::uint32_t num_layers);

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
  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_length,
                            void* data, std::size_t length, const ucp_am_recv_param_t* param);
  static void on_req_done(void* request, ucs_status_t st, void* user_data);
  static void on_data_sent(void* request, ucs_status_t st, void* user_data);
  static void on_recv_done(void* request, ucs_status_t st, std::size_t length, void* user_data);
  static void on_control_sent(void* request, ucs_status_t st, void* user_data);
  static void on_data_ep_flushed(void* request, ucs_status_t st, void* user_data);

  ucs_status_t handle_am(unsigned id, const void* header, std::size_t header_length,
                         void* data, std::size_t length, const ucp_am_recv_param_t* param);
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
  void on_hello(ucp_ep_h ep, const HelloHdr& h);
  void on_auth(ucp_ep_h ep, const AuthHdr& h);
  void on_challenge(const ChallengeHdr& h);
  void serve_hello(ucp_ep_h ep, std::uint64_t conn_id, std::uint64_t ticket);
  void refuse_hello(ucp_ep_h ep, std::uint64_t conn_id, const std::string& why);
  // True when a request carrying `ticket` may be served (always without a
  // token on this owner).
  bool ticket_valid(std::uint64_t ticket) const {
    return options_.auth_token.empty() || (ticket != 0 && tickets_.count(ticket) != 0);
  }
  // A kReqStrided request: validates every span against the region, then
  // serves it as serve_read does, gathering each message's rows from the
  // spans as it goes.
  void serve_strided(ucp_ep_h ep, const ReadReqHdr& h, const std::vector<WireStrided>& spans,
                     std::vector<std::uint32_t> pages);
  // Serves a read's spans (checked against the region here), or its strided
  // spans (checked by serve_strided; spans is then empty).
  void serve_read(ucp_ep_h ep, const ReadReqHdr& h, std::vector<CopySpan> spans,
                  std::vector<StridedSpan> strided, std::vector<std::uint32_t> pages);
  void serve_done(const std::shared_ptr<ServeState>& st);
  Status check_served_epochs(std::uint64_t epoch, const std::vector<std::uint32_t>& pages,
                             const char* when) const;
  void send_epoch_check(const std::shared_ptr<Batch>& b);

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
  void on_ready_req(ucp_ep_h ep, const ReadyReqHdr& h, std::vector<std::uint32_t> pages);
  bool answer_ready(const ReadyHold& r, bool expired);
  void check_ready_holds();
  void on_ready_notice(const ReadyHdr& h, std::string message);
  std::unordered_map<std::uint64_t, std::shared_ptr<ReadyWatch>> watches_;  // [progress]
  std::vector<ReadyHold> ready_holds_;                                     // [progress]

  void on_fin(const std::shared_ptr<Batch>& b, const Status& st);
  void send_err(ucp_ep_h ep, std::uint64_t batch_id, const Status& st);
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
  // Closes `ep` by force; `rkey` and `keep` (the error handler's argument)
  // live until the close completes.
  void close_ep(Endpoint ep, RemoteKey rkey, std::shared_ptr<Conn> keep);
  // Sends a small message whose header and data are copied into a block
  // that lives until the send completes.
  void send_small(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_len,
                  const void* data, std::size_t data_len, bool reply);

  const std::shared_ptr<KVCache> cache_;
  const UcxOptions options_;
  // In creation order: destroyed in reverse (ucx_handles.hpp).
  Context context_;
  Worker worker_;
  MemReg memh_;
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
  std::unordered_map<ucp_ep_h, Endpoint> server_eps_;
  std::set<ucp_ep_h> dead_eps_;       // closed in this progress round
  // The owner's half of the handshake, per listener endpoint: the nonces of
  // a challenge sent, the ticket of an authenticated reader, endpoints that
  // failed (ignored from then on), and the tickets issued.
  std::unordered_map<ucp_ep_h, std::pair<Nonce, Nonce>> challenged_;
  std::unordered_map<ucp_ep_h, std::uint64_t> ep_ticket_;
  std::set<ucp_ep_h> refused_;
  std::set<std::uint64_t> tickets_;
  // The user_data of requests in flight: gets and receives, data replies,
  // control messages. What UCX never completes (written off, see
  // close_conn) is destroyed by stop(), after the worker.
  InFlight<ReqCtx> reads_;
  InFlight<SendCtx> sends_;
  InFlight<Control> controls_;
  std::set<std::uint64_t> draining_;  // aborted get batches waiting to drain
  struct Closing {  // an endpoint's close in flight
    RemoteKey rkey;              // destroyed after the request is freed
    Request request;
    std::shared_ptr<Conn> conn;  // keeps the error-handler argument alive
  };
  std::vector<Closing> closing_;
  std::uint64_t next_conn_ = 1;

 public:
  std::atomic<std::uint64_t> next_batch{1};  // batch ids, unique per core
};

}  // namespace mstar::kv::ucx
