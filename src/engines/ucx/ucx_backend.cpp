// Copyright mstar-kv authors.
#include "ucx_backend.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/auth.hpp"
#include "mstar/kv/epochs.hpp"
#include "rma/rma_engine.hpp"
#include "ucx_auth.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

namespace {

constexpr std::uint64_t kMaxSpansPerRequest = 1u << 22;
// A read gathers (kReqGather) when it has at least this many spans of on
// average fewer bytes than this.
constexpr std::size_t kGatherMinSpans = 64;
constexpr std::uint64_t kGatherBelowBytes = 16u << 10;
// Gets in flight per read. Small enough that an aborted read drains in
// microseconds on shared memory, large enough to keep a NIC busy.
constexpr std::size_t kGetWindow = 16;
// How long an aborted read's gets may take to drain before the connection
// is closed by force.
constexpr std::chrono::milliseconds kDrainGrace{250};

std::string ucs_str(ucs_status_t st) { return ucs_status_string(st); }

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
};

HostPort parse_host_port(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
    throw Error(StatusCode::kInvalidArgument,
                "ucx session id '" + s + "' is not HOST:PORT");
  }
  HostPort hp;
  hp.host = s.substr(0, colon);
  if (hp.host.size() > 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  const std::string port = s.substr(colon + 1);
  unsigned long v = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || v > 65535) {
      throw Error(StatusCode::kInvalidArgument,
                  "ucx session id '" + s + "': port '" + port + "' is not in [1, 65535]");
    }
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v == 0 || v > 65535) {
    throw Error(StatusCode::kInvalidArgument,
                "ucx session id '" + s + "': port " + port + " is not in [1, 65535]");
  }
  hp.port = static_cast<std::uint16_t>(v);
  return hp;
}

sockaddr_storage resolve(const HostPort& hp, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  const int rc = ::getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    throw Error(StatusCode::kInvalidArgument,
                "cannot resolve ucx host '" + hp.host + "': " + ::gai_strerror(rc));
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

}  // namespace

// ---------------------------------------------------------------------------
// UcxCore: everything that touches UCP. Members marked [progress] are used
// only on the progress thread.
// ---------------------------------------------------------------------------

class UcxCore;

struct Conn {
  UcxCore* core = nullptr;
  std::uint64_t id = 0;
  std::string session_id;
  ucp_ep_h ep = nullptr;             // [progress] client/server: control, am reads
  // [progress] to the owner's worker address, where UCX may use shared
  // memory or RDMA: gets, or am reads when its am lane is shared memory.
  ucp_ep_h data_ep = nullptr;
  ucp_rkey_h rkey = nullptr;         // [progress] unpacked on data_ep (get)
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
  // kReqGather: the owner sends groups of chunks; got[i] marks chunk i
  // landed (each exactly once), got_count how many did.
  bool gather = false;
  std::vector<std::uint8_t> got;
  std::size_t got_count = 0;
};

struct ReqCtx {  // user_data of a request that writes into local pages
  UcxCore* core;
  std::uint64_t batch_id;
  std::vector<ucp_dt_iov_t> iov;  // a gathered rendezvous: the local rows
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

struct SendCtx {  // user_data of a data reply (its header must outlive the send)
  UcxCore* core;
  DataHdr hdr;
  std::shared_ptr<ServeState> serve;  // null when no epoch is checked
  GatherHdr gather{};                 // gathered replies (kReqGather)
  std::vector<ucp_dt_iov_t> iov;      // their rows in the registered pages
};

struct AmTag {  // argument of the active-message handler for one id
  UcxCore* core = nullptr;
  unsigned id = 0;
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
  void release_ucp() noexcept;
  void run();
  void open_listener(const std::string& session_id);
  void drain_deferred();
  void check_drains();
  void reap_closing(bool force);

  static void on_conn_request(ucp_conn_request_h req, void* arg);
  static void on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  static void on_client_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  static ucs_status_t on_am(void* arg, const void* header, std::size_t header_length,
                            void* data, std::size_t length, const ucp_am_recv_param_t* param);
  static void on_req_done(void* request, ucs_status_t st, void* user_data);
  static void on_recv_done(void* request, ucs_status_t st, std::size_t length, void* user_data);

  ucs_status_t handle_am(unsigned id, const void* header, std::size_t header_length,
                         void* data, std::size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t handle_data(const DataHdr& h, void* data, std::size_t length,
                           const ucp_am_recv_param_t* param);
  ucs_status_t handle_gather(const GatherHdr& h, void* data, std::size_t length, bool rndv);
  // Owner: sends spans [first, first + count) as one gathered eager message.
  bool send_gathered(ucp_ep_h ep, std::uint64_t batch_id, const std::vector<WireSpan>& spans,
                     std::size_t first, std::size_t count, std::uint64_t flags,
                     const std::shared_ptr<ServeState>& serve);
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
  void serve_read(ucp_ep_h ep, const ReadReqHdr& h, const std::vector<WireSpan>& spans,
                  std::vector<std::uint32_t> pages);
  void serve_done(const std::shared_ptr<ServeState>& st);
  Status check_served_epochs(std::uint64_t epoch, const std::vector<std::uint32_t>& pages,
                             const char* when) const;
  void send_epoch_check(const std::shared_ptr<Batch>& b);

 public:
  // Done notices (leases): reader and owner halves.
  void send_done(const std::shared_ptr<Conn>& c, std::uint64_t seq_id, std::uint64_t epoch) {
    const DoneHdr hdr{seq_id, epoch, c->served.generation, c->ticket};
    send_small(c->ep, kAmDone, &hdr, sizeof hdr, nullptr, 0, true);
  }
  void set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> h) {
    std::lock_guard<std::mutex> lk(done_mu_);
    done_handler_ = std::move(h);
  }

 private:
  std::mutex done_mu_;
  std::function<void(std::uint64_t, std::uint64_t)> done_handler_;  // guarded by done_mu_
  void on_fin(const std::shared_ptr<Batch>& b, const Status& st);
  void send_err(ucp_ep_h ep, std::uint64_t batch_id, const Status& st);
  void hello_reply(const HelloHdr& h, const std::vector<std::uint8_t>& bytes);
  void request_finished(std::uint64_t batch_id, ucs_status_t st);
  void post_gets(const std::shared_ptr<Batch>& b);
  // Contexts of requests that write locally; those UCX never completes
  // (written off, see close_conn) are freed by stop().
  ReqCtx* new_ctx(std::uint64_t batch_id) {
    auto* c = new ReqCtx{this, batch_id, {}};
    live_ctx_.insert(c);
    return c;
  }
  void free_ctx(ReqCtx* c) {
    live_ctx_.erase(c);
    delete c;
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
  void close_ep(ucp_ep_h ep, ucp_rkey_h rkey, std::shared_ptr<Conn> keep);
  // Sends a small message whose header and data are copied into a block
  // that lives until the send completes.
  void send_small(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_len,
                  const void* data, std::size_t data_len, bool reply);

  const std::shared_ptr<KVCache> cache_;
  const UcxOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int efd_ = -1;
  rma::RmaRegionInfo region_;
  std::vector<std::uint8_t> worker_address_;  // sent in the hello reply
  AmTag am_tags_[kAmMaxId + 1];

  std::mutex mu_;
  std::deque<std::function<void()>> commands_;  // guarded by mu_
  bool stopped_ = false;                        // guarded by mu_
  std::atomic<bool> stop_requested_{false};
  std::mutex stop_mu_;
  std::thread thread_;

  // [progress]
  std::vector<std::function<void()>> deferred_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Conn>> conns_;
  std::unordered_map<std::uint64_t, std::shared_ptr<Batch>> batches_;
  std::set<ucp_ep_h> server_eps_;
  std::set<ucp_ep_h> dead_eps_;       // closed in this progress round
  // The owner's half of the handshake, per listener endpoint: the nonces of
  // a challenge sent, the ticket of an authenticated reader, endpoints that
  // failed (ignored from then on), and the tickets issued.
  std::unordered_map<ucp_ep_h, std::pair<Nonce, Nonce>> challenged_;
  std::unordered_map<ucp_ep_h, std::uint64_t> ep_ticket_;
  std::set<ucp_ep_h> refused_;
  std::set<std::uint64_t> tickets_;
  std::set<ReqCtx*> live_ctx_;
  std::set<SendCtx*> live_sends_;     // data replies not completed yet
  std::set<std::uint64_t> draining_;  // aborted get batches waiting to drain
  struct Closing {
    void* request;
    ucp_rkey_h rkey;
    std::shared_ptr<Conn> conn;  // keeps the error-handler argument alive
  };
  std::vector<Closing> closing_;
  std::uint64_t next_conn_ = 1;

 public:
  std::atomic<std::uint64_t> next_batch{1};  // batch ids, unique per core
};

UcxCore::UcxCore(std::shared_ptr<KVCache> cache, const std::string& entity_id,
                 const std::string& session_id, const UcxOptions& options)
    : cache_(std::move(cache)), options_(options) {
  if (cache_->memory_kind() == MemoryKind::kDevice) {
    throw Error(StatusCode::kInvalidArgument,
                "the ucx engine needs a host-memory cache (make_kv_cache(layout, "
                "MemoryKind::kHost)), got device memory");
  }
  region_.entity_id = entity_id;
  region_.data_ptr = reinterpret_cast<std::uintptr_t>(cache_->base());
  region_.size = cache_->size_bytes();
  region_.layout = cache_->layout();
  region_.generation = rma::new_generation();
  try {
    init_ucp(session_id);
  } catch (...) {
    release_ucp();
    throw;
  }
  thread_ = std::thread([this] { run(); });
}

void UcxCore::init_ucp(const std::string& session_id) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_config_read: " + ucs_str(st));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    context_ = nullptr;
    throw Error(StatusCode::kUnavailable, "ucp_init: " + ucs_str(st));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wp, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    throw Error(StatusCode::kUnavailable, "ucp_worker_create: " + ucs_str(st));
  }
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;  // then poll busily

  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = cache_->base();
  mp.length = cache_->size_bytes();
  st = ucp_mem_map(context_, &mp, &memh_);
  if (st != UCS_OK) {
    memh_ = nullptr;
    throw Error(StatusCode::kUnavailable,
                "ucp_mem_map of " + std::to_string(mp.length) + " bytes: " + ucs_str(st));
  }
  void* rkey_buf = nullptr;
  std::size_t rkey_len = 0;
  st = ucp_rkey_pack(context_, memh_, &rkey_buf, &rkey_len);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_rkey_pack: " + ucs_str(st));
  region_.backend_blob.assign(static_cast<std::uint8_t*>(rkey_buf),
                              static_cast<std::uint8_t*>(rkey_buf) + rkey_len);
  ucp_rkey_buffer_release(rkey_buf);

  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  st = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_worker_get_address: " + ucs_str(st));
  worker_address_.assign(reinterpret_cast<std::uint8_t*>(addr),
                         reinterpret_cast<std::uint8_t*>(addr) + addr_len);
  ucp_worker_release_address(worker_, addr);

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = &UcxCore::on_am;
  for (unsigned id :
       {kAmHello, kAmHelloReply, kAmReadReq, kAmReadData, kAmReadErr, kAmReadFin, kAmDone,
        kAmChallenge, kAmAuth, kAmGatherData}) {
    am_tags_[id] = AmTag{this, id};
    hp.id = id;
    hp.arg = &am_tags_[id];
    st = ucp_worker_set_am_recv_handler(worker_, &hp);
    if (st != UCS_OK) {
      throw Error(StatusCode::kUnavailable, "ucp_worker_set_am_recv_handler: " + ucs_str(st));
    }
  }
  open_listener(session_id);
}

void UcxCore::release_ucp() noexcept {
  if (listener_) ucp_listener_destroy(listener_);
  listener_ = nullptr;
  if (memh_) ucp_mem_unmap(context_, memh_);
  memh_ = nullptr;
  if (worker_) ucp_worker_destroy(worker_);
  worker_ = nullptr;
  if (context_) ucp_cleanup(context_);
  context_ = nullptr;
}

void UcxCore::open_listener(const std::string& session_id) {
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.conn_handler.cb = &UcxCore::on_conn_request;
  lp.conn_handler.arg = this;
  auto try_open = [&](const HostPort& hp) {
    socklen_t len = 0;
    sockaddr_storage ss = resolve(hp, &len);
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = len;
    const ucs_status_t st = ucp_listener_create(worker_, &lp, &listener_);
    if (st != UCS_OK) listener_ = nullptr;
    return st;
  };
  // "HOST:PORT" listens there. Empty, or a bare name without ':' (a label
  // such as the demo's "demo-<pid>"), listens on 127.0.0.1 at a free port.
  if (session_id.find(':') != std::string::npos) {
    const HostPort hp = parse_host_port(session_id);
    const ucs_status_t st = try_open(hp);
    if (st != UCS_OK) {
      throw Error(st == UCS_ERR_BUSY ? StatusCode::kRetryLater : StatusCode::kUnavailable,
                  "cannot listen on ucx session '" + session_id + "': " + ucs_str(st));
    }
    region_.session_id = session_id;
    return;
  }
  std::random_device rd;
  std::mt19937 rng(rd());
  std::uniform_int_distribution<int> port(20000, 29999);
  ucs_status_t st = UCS_OK;
  for (int attempt = 0; attempt < 64; ++attempt) {
    const HostPort hp{"127.0.0.1", static_cast<std::uint16_t>(port(rng))};
    st = try_open(hp);
    if (st == UCS_OK) {
      region_.session_id = hp.host + ":" + std::to_string(hp.port);
      return;
    }
  }
  throw Error(StatusCode::kUnavailable,
              "no free port in 20000-29999 for the ucx listener: " + ucs_str(st));
}

UcxCore::~UcxCore() { stop(); }

bool UcxCore::post(std::function<void()> cmd) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return false;
    commands_.push_back(std::move(cmd));
  }
  ucp_worker_signal(worker_);  // safe from any thread
  return true;
}

void UcxCore::drain_deferred() {
  while (!deferred_.empty()) {
    auto work = std::move(deferred_);
    deferred_.clear();
    for (auto& w : work) w();
  }
  dead_eps_.clear();
}

void UcxCore::check_drains() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = draining_.begin(); it != draining_.end();) {
    auto b = batches_.find(*it);
    if (b == batches_.end()) {
      it = draining_.erase(it);
      continue;
    }
    if (now < b->second->drain_deadline) {
      ++it;
      continue;
    }
    auto conn = b->second->conn;
    it = draining_.erase(it);
    close_conn(conn,
               Status(StatusCode::kCancelled,
                      "gets of a stopped read did not drain in " +
                          std::to_string(kDrainGrace.count()) + " ms"),
               true);
  }
}

void UcxCore::reap_closing(bool force) {
  for (auto it = closing_.begin(); it != closing_.end();) {
    if (force || ucp_request_check_status(it->request) != UCS_INPROGRESS) {
      ucp_request_free(it->request);
      if (it->rkey) ucp_rkey_destroy(it->rkey);
      it = closing_.erase(it);
    } else {
      ++it;
    }
  }
}

void UcxCore::run() {
  using Clock = std::chrono::steady_clock;
  int idle = 0;
  bool closing_all = false;
  auto deadline = Clock::time_point::max();
  // Reused across iterations: a libstdc++ deque allocates even when empty,
  // and this loop spins while transfers are in flight.
  std::deque<std::function<void()>> cmds;
  for (;;) {
    cmds.clear();
    {
      std::lock_guard<std::mutex> lk(mu_);
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();
    unsigned progressed = 0;
    while (unsigned n = ucp_worker_progress(worker_)) {
      progressed += n;
      drain_deferred();
    }
    drain_deferred();
    reap_closing(false);
    if (!draining_.empty()) check_drains();
    if (!closing_all && stop_requested_.load(std::memory_order_acquire)) {
      closing_all = true;
      deadline = Clock::now() + std::chrono::seconds(2);
      std::deque<std::function<void()>> last;
      {
        std::lock_guard<std::mutex> lk(mu_);
        stopped_ = true;  // post() refuses from now on
        last.swap(commands_);
      }
      for (auto& c : last) c();
      auto conns = conns_;
      for (auto& [id, c] : conns) {
        close_conn(c, Status(StatusCode::kShutdown, "the ucx engine shut down"), true);
      }
      auto seps = server_eps_;
      for (ucp_ep_h ep : seps) close_server_ep(ep);
      if (listener_) ucp_listener_destroy(listener_);
      listener_ = nullptr;
      continue;
    }
    if (closing_all) {
      if ((closing_.empty() && batches_.empty()) || Clock::now() > deadline) break;
      continue;
    }
    if (progressed != 0 || !cmds.empty()) {
      idle = 0;
      continue;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!commands_.empty()) continue;
    }
    // Idle: spin a little (yielding: the machine may be shared), then sleep
    // on the worker's event fd. While reads or data replies are in flight
    // the sleep is 1 ms at most: shared-memory transports raise no event
    // when the peer frees room in a fifo or a get completes.
    const bool busy = !batches_.empty() || !live_sends_.empty();
    if (++idle < (busy ? 32 : 256) || efd_ < 0) {
      if (efd_ < 0 && idle >= 256) std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::this_thread::yield();
      continue;
    }
    idle = 0;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    pollfd pfd{efd_, POLLIN, 0};
    (void)::poll(&pfd, 1, busy ? 1 : (draining_.empty() ? 100 : 10));
  }
  // What UCX did not complete in the grace period: the worker is destroyed
  // right after this returns, so nothing can land any more.
  auto left = batches_;
  for (auto& [id, b] : left) {
    b->outstanding = 0;
    fail_batch(b, Status(StatusCode::kShutdown, "the ucx engine shut down"));
  }
}

void UcxCore::stop() noexcept {
  std::lock_guard<std::mutex> lk(stop_mu_);
  if (!worker_) return;
  if (thread_.joinable()) {
    stop_requested_.store(true, std::memory_order_release);
    ucp_worker_signal(worker_);
    thread_.join();
  }
  {
    std::lock_guard<std::mutex> lk2(mu_);
    stopped_ = true;
    commands_.clear();
  }
  reap_closing(true);
  conns_.clear();
  batches_.clear();
  release_ucp();
  for (ReqCtx* c : live_ctx_) delete c;
  live_ctx_.clear();
  for (SendCtx* c : live_sends_) delete c;
  live_sends_.clear();
}

// ---- server side -----------------------------------------------------------

void UcxCore::on_conn_request(ucp_conn_request_h req, void* arg) {
  auto* self = static_cast<UcxCore*>(arg);
  if (self->stop_requested_.load(std::memory_order_acquire)) {
    ucp_listener_reject(self->listener_, req);
    return;
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &UcxCore::on_server_ep_error;
  ep.err_handler.arg = self;
  ucp_ep_h h = nullptr;
  if (ucp_ep_create(self->worker_, &ep, &h) == UCS_OK) self->server_eps_.insert(h);
}

void UcxCore::on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* self = static_cast<UcxCore*>(arg);
  self->deferred_.push_back([self, ep] { self->close_server_ep(ep); });
}

void UcxCore::close_server_ep(ucp_ep_h ep) {
  if (server_eps_.erase(ep) == 0) return;
  challenged_.erase(ep);
  refused_.erase(ep);
  if (auto t = ep_ticket_.find(ep); t != ep_ticket_.end()) {
    tickets_.erase(t->second);  // the reader's requests are refused from now on
    ep_ticket_.erase(t);
  }
  dead_eps_.insert(ep);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &rp);
  if (UCS_PTR_IS_PTR(sp)) closing_.push_back({sp, nullptr, nullptr});
}

void UcxCore::send_small(ucp_ep_h ep, unsigned id, const void* header,
                         std::size_t header_len, const void* data, std::size_t data_len,
                         bool reply) {
  auto* block = new std::vector<std::uint8_t>(header_len + data_len);
  if (header_len) std::memcpy(block->data(), header, header_len);
  if (data_len) std::memcpy(block->data() + header_len, data, data_len);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA;
  rp.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  rp.cb.send = [](void* req, ucs_status_t, void* ud) {
    delete static_cast<std::vector<std::uint8_t>*>(ud);
    ucp_request_free(req);
  };
  rp.user_data = block;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, id, block->data(), header_len,
                                        block->data() + header_len, data_len, &rp);
  if (!UCS_PTR_IS_PTR(sp)) delete block;
}

void UcxCore::on_hello(ucp_ep_h ep, const HelloHdr& h) {
  if (server_eps_.count(ep) == 0 || refused_.count(ep) != 0 || challenged_.count(ep) != 0 ||
      ep_ticket_.count(ep) != 0) {
    return;  // one handshake per endpoint
  }
  if (options_.auth_token.empty()) {
    serve_hello(ep, h.conn_id, 0);
    return;
  }
  // Prove the secret first (mutual authentication), over the reader's nonce
  // and a fresh one of ours; the region goes out only after the reader's
  // proof (on_auth). A reader without a token learns it needs one.
  Nonce nonce_r;
  std::memcpy(nonce_r.data(), h.nonce, kNonceBytes);
  const Nonce nonce_o = new_nonce();
  challenged_[ep] = {nonce_r, nonce_o};
  ChallengeHdr c{};
  c.conn_id = h.conn_id;
  std::memcpy(c.nonce, nonce_o.data(), kNonceBytes);
  const Mac mac = owner_proof(options_.auth_token, nonce_r, nonce_o);
  std::memcpy(c.mac, mac.data(), kMacBytes);
  send_small(ep, kAmChallenge, &c, sizeof c, nullptr, 0, false);
}

void UcxCore::on_auth(ucp_ep_h ep, const AuthHdr& h) {
  auto it = challenged_.find(ep);
  if (server_eps_.count(ep) == 0 || it == challenged_.end()) return;
  const auto [nonce_r, nonce_o] = it->second;
  challenged_.erase(it);
  if (!proof_matches(reader_proof(options_.auth_token, nonce_r, nonce_o), h.mac)) {
    refused_.insert(ep);  // one try per connection
    refuse_hello(ep, h.conn_id,
                 "the reader's proof of the auth_token is wrong (the tokens differ)");
    return;
  }
  std::uint64_t ticket = new_ticket();
  while (tickets_.count(ticket) != 0) ticket = new_ticket();
  tickets_.insert(ticket);
  ep_ticket_[ep] = ticket;
  serve_hello(ep, h.conn_id, ticket);
}

void UcxCore::refuse_hello(ucp_ep_h ep, std::uint64_t conn_id, const std::string& why) {
  HelloHdr hdr{};
  hdr.conn_id = conn_id;
  hdr.code = static_cast<std::uint32_t>(StatusCode::kPermissionDenied);
  send_small(ep, kAmHelloReply, &hdr, sizeof hdr, why.data(), why.size(), false);
}

void UcxCore::serve_hello(ucp_ep_h ep, std::uint64_t conn_id, std::uint64_t ticket) {
  // Reply: u32 region length | RmaRegionInfo bytes | worker address. The
  // address lets a reader open a second endpoint on which UCX may pick
  // shared-memory or RDMA transports for gets (client/server endpoints only
  // use transports reachable through the connection manager).
  HelloHdr hdr{};
  hdr.conn_id = conn_id;
  hdr.ticket = ticket;
  const std::vector<std::uint8_t> region = region_.encode();
  std::vector<std::uint8_t> bytes(4 + region.size() + worker_address_.size());
  const std::uint32_t n = static_cast<std::uint32_t>(region.size());
  std::memcpy(bytes.data(), &n, 4);
  std::memcpy(bytes.data() + 4, region.data(), region.size());
  if (!worker_address_.empty()) {
    std::memcpy(bytes.data() + 4 + region.size(), worker_address_.data(),
                worker_address_.size());
  }
  send_small(ep, kAmHelloReply, &hdr, sizeof hdr, bytes.data(), bytes.size(), false);
}

void UcxCore::send_err(ucp_ep_h ep, std::uint64_t batch_id, const Status& st) {
  const ErrHdr hdr{batch_id, static_cast<std::uint32_t>(st.code()), 0};
  send_small(ep, kAmReadErr, &hdr, sizeof hdr, st.message().data(), st.message().size(), false);
}

Status UcxCore::check_served_epochs(std::uint64_t epoch,
                                   const std::vector<std::uint32_t>& pages,
                                   const char* when) const {
  const PageEpochs& ep = cache_->epochs();
  return check_page_epochs(ep.words(), ep.num_pages(), pages, epoch, when,
                           /*after_copy=*/true);
}

void UcxCore::serve_read(ucp_ep_h ep, const ReadReqHdr& h, const std::vector<WireSpan>& spans,
                         std::vector<std::uint32_t> pages) {
  const std::uint64_t batch_id = h.batch_id;
  const std::uint64_t flags = h.flags;
  // The reply endpoint is one of our listener's endpoints or one UCX made
  // for a reader's data endpoint; only a listener endpoint closed since the
  // request arrived (same progress round) is gone.
  if (dead_eps_.count(ep) != 0) return;
  // Validate the whole request before sending a byte: the reader is not
  // trusted with anything outside the registered region.
  if (h.generation != region_.generation) {
    send_err(ep, batch_id,
             Status(StatusCode::kStaleDescriptor,
                    "read names generation " + std::to_string(h.generation) +
                        ", this owner serves generation " +
                        std::to_string(region_.generation)));
    return;
  }
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const WireSpan& s = spans[i];
    if (s.length == 0 || s.remote_offset > region_.size ||
        s.length > region_.size - s.remote_offset) {
      send_err(ep, batch_id,
               Status(StatusCode::kPermissionDenied,
                      "span " + std::to_string(i) + " [" + std::to_string(s.remote_offset) +
                          ", +" + std::to_string(s.length) +
                          ") is outside the registered region of " +
                          std::to_string(region_.size) + " bytes"));
      return;
    }
  }
  // Owner-served: the pages must still belong to the reader's sequence
  // before the first byte goes out (and after the last, in serve_done).
  std::shared_ptr<ServeState> serve;
  if (h.epoch != 0) {
    if (Status st = check_served_epochs(h.epoch, pages, "before the owner sent it");
        !st.is_ok()) {
      send_err(ep, batch_id, st);
      return;
    }
    serve = std::make_shared<ServeState>();
    serve->ep = ep;
    serve->batch_id = batch_id;
    serve->epoch = h.epoch;
    serve->pages = std::move(pages);
    serve->left = spans.size() + 1;
  }
  if ((flags & kReqGather) != 0) {
    // Groups of consecutive spans, each one eager message (kAmGatherData).
    std::vector<std::pair<std::size_t, std::size_t>> groups;
    for (std::size_t i = 0; i < spans.size();) {
      std::size_t j = i;
      std::uint64_t bytes = 0;
      while (j < spans.size() && j - i < kGatherMaxSpans &&
             (j == i || bytes + spans[j].length <= kGatherBytes)) {
        bytes += spans[j].length;
        ++j;
      }
      groups.emplace_back(i, j - i);
      i = j;
    }
    if (serve) serve->left = groups.size() + 1;
    for (const auto& [first, count] : groups) {
      if (!send_gathered(ep, batch_id, spans, first, count, flags, serve)) return;
    }
    if (serve && --serve->left == 0) serve_done(serve);
    return;
  }
  for (const WireSpan& s : spans) {
    auto* ctx = new SendCtx{this, DataHdr{batch_id, s.local_offset, s.length}, serve, {}, {}};
    live_sends_.insert(ctx);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                      UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    rp.flags = (flags & kReqEagerOnly) == 0 && s.length >= options_.rndv_bytes
                   ? UCP_AM_SEND_FLAG_RNDV
                   : UCP_AM_SEND_FLAG_EAGER;
    rp.memh = memh_;
    rp.cb.send = [](void* req, ucs_status_t st, void* ud) {
      auto* c = static_cast<SendCtx*>(ud);
      c->core->live_sends_.erase(c);
      if (c->serve) {
        if (st != UCS_OK) c->serve->failed = true;
        if (--c->serve->left == 0) {
          UcxCore* core = c->core;
          core->deferred_.push_back([core, sv = c->serve] { core->serve_done(sv); });
        }
      }
      delete c;
      ucp_request_free(req);
    };
    rp.user_data = ctx;
    ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmReadData, &ctx->hdr, sizeof ctx->hdr,
                                          cache_->base() + s.remote_offset, s.length, &rp);
    if (!UCS_PTR_IS_PTR(sp)) {
      live_sends_.erase(ctx);
      delete ctx;
      if (serve) --serve->left;
    }
    if (UCS_PTR_IS_ERR(sp)) return;  // the endpoint failed; its error handler closes it
  }
  if (serve && --serve->left == 0) serve_done(serve);
}

bool UcxCore::send_gathered(ucp_ep_h ep, std::uint64_t batch_id,
                            const std::vector<WireSpan>& spans, std::size_t first,
                            std::size_t count, std::uint64_t flags,
                            const std::shared_ptr<ServeState>& serve) {
  auto* ctx = new SendCtx{this, DataHdr{}, serve, {}, {}};
  ctx->iov.resize(count);
  std::uint64_t bytes = 0;
  for (std::size_t k = 0; k < count; ++k) {
    const WireSpan& s = spans[first + k];
    ctx->iov[k].buffer = cache_->base() + s.remote_offset;
    ctx->iov[k].length = s.length;
    bytes += s.length;
  }
  ctx->gather = GatherHdr{batch_id, first, count, bytes};
  live_sends_.insert(ctx);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  // Rendezvous for big groups (UCX moves the rows from our pages into the
  // reader's, an iov on both sides), eager otherwise (the reader scatters
  // from its receive buffer); eager only for readers that ask for it.
  rp.flags = (flags & kReqEagerOnly) == 0 && bytes >= options_.rndv_bytes ? UCP_AM_SEND_FLAG_RNDV
                                                                        : UCP_AM_SEND_FLAG_EAGER;
  rp.datatype = ucp_dt_make_iov();
  rp.cb.send = [](void* req, ucs_status_t st, void* ud) {
    auto* c = static_cast<SendCtx*>(ud);
    c->core->live_sends_.erase(c);
    if (c->serve) {
      if (st != UCS_OK) c->serve->failed = true;
      if (--c->serve->left == 0) {
        UcxCore* core = c->core;
        core->deferred_.push_back([core, sv = c->serve] { core->serve_done(sv); });
      }
    }
    delete c;
    ucp_request_free(req);
  };
  rp.user_data = ctx;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmGatherData, &ctx->gather, sizeof ctx->gather,
                                        ctx->iov.data(), ctx->iov.size(), &rp);
  if (!UCS_PTR_IS_PTR(sp)) {
    live_sends_.erase(ctx);
    delete ctx;
    if (serve) --serve->left;
  }
  return !UCS_PTR_IS_ERR(sp);  // the endpoint failed: its error handler closes it
}

ucs_status_t UcxCore::handle_gather(const GatherHdr& h, void* data, std::size_t length,
                                    bool rndv) {
  auto it = batches_.find(h.batch_id);
  if (it == batches_.end()) return UCS_OK;  // a stopped or unknown read: dropped
  auto b = it->second;
  if (b->aborted || b->failure) return UCS_OK;
  // Untrusted: a group of this read's spans, each once, with their bytes.
  bool ok = b->gather && h.count > 0 && h.first < b->chunks.size() &&
            h.count <= b->chunks.size() - h.first && h.length == length && data != nullptr;
  std::uint64_t bytes = 0;
  for (std::size_t k = 0; ok && k < h.count; ++k) {
    ok = b->got[h.first + k] == 0;
    bytes += b->chunks[h.first + k].length;
  }
  if (!ok || bytes != length) {
    fail_batch(b, Status(StatusCode::kInternal,
                         "owner sent a gathered reply (spans " + std::to_string(h.first) + "+" +
                             std::to_string(h.count) + ", " + std::to_string(length) +
                             " bytes) that the read did not ask for"));
    return UCS_OK;
  }
  if (rndv) {  // UCX lands the bytes straight in the local rows (an iov)
    auto* ctx = new_ctx(b->id);
    ctx->iov.resize(h.count);
    for (std::size_t k = 0; k < h.count; ++k) {
      const rma::RmaRead& r = b->chunks[h.first + k];
      ctx->iov[k].buffer = cache_->base() + r.local_offset;
      ctx->iov[k].length = r.length;
      b->got[h.first + k] = 1;
    }
    b->got_count += h.count;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_DATATYPE;
    rp.cb.recv_am = &UcxCore::on_recv_done;
    rp.user_data = ctx;
    rp.datatype = ucp_dt_make_iov();
    ucs_status_ptr_t sp = ucp_am_recv_data_nbx(worker_, data, ctx->iov.data(), ctx->iov.size(), &rp);
    if (UCS_PTR_IS_PTR(sp)) {
      ++b->outstanding;
      return UCS_INPROGRESS;
    }
    free_ctx(ctx);
    if (UCS_PTR_IS_ERR(sp)) {
      fail_batch(b, Status(StatusCode::kPeerFailure,
                           "ucp_am_recv_data_nbx: " + ucs_str(UCS_PTR_STATUS(sp))));
    } else {
      maybe_finish(b);
    }
    return UCS_INPROGRESS;
  }
  const auto* src = static_cast<const std::byte*>(data);
  for (std::size_t k = 0; k < h.count; ++k) {
    const rma::RmaRead& r = b->chunks[h.first + k];
    std::memcpy(cache_->base() + r.local_offset, src, r.length);
    src += r.length;
    b->got[h.first + k] = 1;
  }
  b->got_count += h.count;
  maybe_finish(b);
  return UCS_OK;
}

void UcxCore::serve_done(const std::shared_ptr<ServeState>& st) {
  if (st->failed || dead_eps_.count(st->ep) != 0) return;  // the reader fails by itself
  Status s = check_served_epochs(st->epoch, st->pages, "while the owner sent it");
  const ErrHdr hdr{st->batch_id, static_cast<std::uint32_t>(s.code()), 0};
  send_small(st->ep, kAmReadFin, &hdr, sizeof hdr, s.message().data(), s.message().size(),
             false);
}

// ---- active messages -------------------------------------------------------

ucs_status_t UcxCore::on_am(void* arg, const void* header, std::size_t header_length,
                            void* data, std::size_t length, const ucp_am_recv_param_t* param) {
  auto* tag = static_cast<AmTag*>(arg);
  return tag->core->handle_am(tag->id, header, header_length, data, length, param);
}

ucs_status_t UcxCore::handle_am(unsigned id, const void* header, std::size_t header_length,
                                void* data, std::size_t length,
                                const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool has_reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
  switch (id) {
    case kAmHello: {
      if (header_length != sizeof(HelloHdr) || !has_reply_ep || rndv) return UCS_OK;
      HelloHdr h;
      std::memcpy(&h, header, sizeof h);
      ucp_ep_h ep = param->reply_ep;
      deferred_.push_back([this, ep, h] { on_hello(ep, h); });
      return UCS_OK;
    }
    case kAmAuth: {
      if (header_length != sizeof(AuthHdr) || !has_reply_ep || rndv) return UCS_OK;
      AuthHdr h;
      std::memcpy(&h, header, sizeof h);
      ucp_ep_h ep = param->reply_ep;
      deferred_.push_back([this, ep, h] { on_auth(ep, h); });
      return UCS_OK;
    }
    case kAmChallenge: {
      if (header_length != sizeof(ChallengeHdr) || rndv) return UCS_OK;
      ChallengeHdr h;
      std::memcpy(&h, header, sizeof h);
      deferred_.push_back([this, h] { on_challenge(h); });
      return UCS_OK;
    }
    case kAmHelloReply: {
      if (header_length != sizeof(HelloHdr) || rndv) return UCS_OK;
      HelloHdr h;
      std::memcpy(&h, header, sizeof h);
      std::vector<std::uint8_t> bytes(static_cast<std::uint8_t*>(data),
                                      static_cast<std::uint8_t*>(data) + length);
      deferred_.push_back([this, h, b = std::move(bytes)] { hello_reply(h, b); });
      return UCS_OK;
    }
    case kAmReadReq: {
      if (header_length != sizeof(ReadReqHdr) || !has_reply_ep || rndv) return UCS_OK;
      ReadReqHdr h;
      std::memcpy(&h, header, sizeof h);
      ucp_ep_h ep = param->reply_ep;
      const bool check_only = (h.flags & kReqCheckOnly) != 0;
      // Untrusted: the counts must match the length exactly, pages only
      // come with an epoch, a check-only request has no spans.
      if ((check_only ? h.nspans != 0 : (h.nspans == 0 || h.nspans > kMaxSpansPerRequest)) ||
          h.npages > kMaxSpansPerRequest || (h.epoch == 0 && (h.npages != 0 || check_only)) ||
          length != h.nspans * sizeof(WireSpan) + h.npages * sizeof(std::uint32_t)) {
        deferred_.push_back([this, ep, h] {
          send_err(ep, h.batch_id,
                   Status(StatusCode::kInvalidArgument, "malformed read request"));
        });
        return UCS_OK;
      }
      if (!ticket_valid(h.ticket)) {
        deferred_.push_back([this, ep, h] {
          send_err(ep, h.batch_id,
                   Status(StatusCode::kPermissionDenied,
                          "read request without the ticket of an authenticated connection"));
        });
        return UCS_OK;
      }
      std::vector<WireSpan> spans(h.nspans);
      std::vector<std::uint32_t> pages(h.npages);
      if (h.nspans) std::memcpy(spans.data(), data, h.nspans * sizeof(WireSpan));
      if (h.npages) {
        std::memcpy(pages.data(), static_cast<const std::byte*>(data) + h.nspans * sizeof(WireSpan),
                    h.npages * sizeof(std::uint32_t));
      }
      if (check_only) {
        deferred_.push_back([this, ep, h, p = std::move(pages)] {
          if (dead_eps_.count(ep) != 0) return;
          Status st = check_served_epochs(h.epoch, p, "around the gets");
          const ErrHdr fin{h.batch_id, static_cast<std::uint32_t>(st.code()), 0};
          send_small(ep, kAmReadFin, &fin, sizeof fin, st.message().data(),
                     st.message().size(), false);
        });
        return UCS_OK;
      }
      deferred_.push_back([this, ep, h, s = std::move(spans), p = std::move(pages)]() mutable {
        serve_read(ep, h, s, std::move(p));
      });
      return UCS_OK;
    }
    case kAmReadData: {
      if (header_length != sizeof(DataHdr)) return UCS_OK;
      DataHdr h;
      std::memcpy(&h, header, sizeof h);
      return handle_data(h, data, length, param);
    }
    case kAmGatherData: {
      if (header_length != sizeof(GatherHdr)) return UCS_OK;
      GatherHdr h;
      std::memcpy(&h, header, sizeof h);
      return handle_gather(h, data, length, rndv);
    }
    case kAmReadErr: {
      if (header_length != sizeof(ErrHdr) || rndv) return UCS_OK;
      ErrHdr h;
      std::memcpy(&h, header, sizeof h);
      auto it = batches_.find(h.batch_id);
      if (it == batches_.end()) return UCS_OK;
      StatusCode code = static_cast<StatusCode>(h.code);
      if (h.code > static_cast<std::uint32_t>(StatusCode::kInternal) || h.code == 0) {
        code = StatusCode::kInternal;
      }
      std::string msg(static_cast<const char*>(data), std::min<std::size_t>(length, 1024));
      fail_batch(it->second, Status(code, "owner rejected the read: " + msg));
      return UCS_OK;
    }
    case kAmDone: {
      if (header_length != sizeof(DoneHdr) || rndv) return UCS_OK;
      DoneHdr h;
      std::memcpy(&h, header, sizeof h);
      // A notice for another registration of this cache is stale: ignore it.
      if (h.generation != region_.generation || h.epoch == 0 || !ticket_valid(h.ticket)) {
        return UCS_OK;
      }
      deferred_.push_back([this, h] {
        std::function<void(std::uint64_t, std::uint64_t)> handler;
        {
          std::lock_guard<std::mutex> lk(done_mu_);
          handler = done_handler_;
        }
        if (handler) handler(h.seq_id, h.epoch);
      });
      return UCS_OK;
    }
    case kAmReadFin: {
      if (header_length != sizeof(ErrHdr) || rndv) return UCS_OK;
      ErrHdr h;
      std::memcpy(&h, header, sizeof h);
      auto it = batches_.find(h.batch_id);
      if (it == batches_.end()) return UCS_OK;
      // Only kOk or kStaleDescriptor are answers; anything else is a broken owner.
      Status st;
      if (h.code == static_cast<std::uint32_t>(StatusCode::kStaleDescriptor)) {
        st = Status(StatusCode::kStaleDescriptor,
                    std::string(static_cast<const char*>(data), std::min<std::size_t>(length, 1024)));
      } else if (h.code != 0) {
        st = Status(StatusCode::kInternal, "owner answered an epoch check with code " +
                                               std::to_string(h.code));
      }
      on_fin(it->second, st);
      return UCS_OK;
    }
    default:
      return UCS_OK;
  }
}

ucs_status_t UcxCore::handle_data(const DataHdr& h, void* data, std::size_t length,
                                  const ucp_am_recv_param_t* param) {
  auto it = batches_.find(h.batch_id);
  // A stopped or unknown read: drop the data (a rendezvous is dropped too,
  // and the owner's send completes).
  if (it == batches_.end()) return UCS_OK;
  auto b = it->second;
  if (b->aborted || b->failure) return UCS_OK;
  auto p = b->pending.find(h.local_offset);
  if (p == b->pending.end() || p->second != h.length || h.length != length) {
    // The owner sent something this read did not ask for: never write it.
    fail_batch(b, Status(StatusCode::kInternal,
                         "owner sent " + std::to_string(length) + " bytes for local offset " +
                             std::to_string(h.local_offset) + " that the read did not ask for"));
    return UCS_OK;
  }
  b->pending.erase(p);
  std::byte* dest = cache_->base() + h.local_offset;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    std::memcpy(dest, data, length);
    maybe_finish(b);
    return UCS_OK;
  }
  auto* ctx = new_ctx(b->id);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                    UCP_OP_ATTR_FIELD_MEMH;
  rp.cb.recv_am = &UcxCore::on_recv_done;
  rp.user_data = ctx;
  rp.memh = memh_;
  ucs_status_ptr_t sp = ucp_am_recv_data_nbx(worker_, data, dest, length, &rp);
  if (UCS_PTR_IS_PTR(sp)) {
    ++b->outstanding;
    return UCS_INPROGRESS;
  }
  free_ctx(ctx);
  if (UCS_PTR_IS_ERR(sp)) {
    fail_batch(b, Status(StatusCode::kPeerFailure,
                         "ucp_am_recv_data_nbx: " + ucs_str(UCS_PTR_STATUS(sp))));
  } else {
    maybe_finish(b);
  }
  return UCS_INPROGRESS;
}

// ---- client side -----------------------------------------------------------

std::shared_ptr<Conn> UcxCore::connect(const rma::RmaRegionInfo& remote,
                                       std::chrono::milliseconds timeout) {
  const HostPort hp = parse_host_port(remote.session_id);
  socklen_t len = 0;
  const sockaddr_storage ss = resolve(hp, &len);
  auto conn = std::make_shared<Conn>();
  conn->core = this;
  conn->session_id = remote.session_id;
  std::future<Status> hello = conn->hello.get_future();
  const bool posted = post([this, conn, ss, len] {
    conn->id = next_conn_++;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    ep.sockaddr.addrlen = len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxCore::on_client_ep_error;
    ep.err_handler.arg = conn.get();
    const ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->ep);
    if (st != UCS_OK) {
      conn->ep = nullptr;
      close_conn(conn, Status(StatusCode::kPeerFailure, "ucp_ep_create: " + ucs_str(st)));
      return;
    }
    conns_[conn->id] = conn;
    HelloHdr hdr{};
    hdr.conn_id = conn->id;
    hdr.flags = options_.auth_token.empty() ? 0 : kHelloHasToken;
    conn->nonce_r = new_nonce();
    std::memcpy(hdr.nonce, conn->nonce_r.data(), kNonceBytes);
    send_small(conn->ep, kAmHello, &hdr, sizeof hdr, nullptr, 0, true);
  });
  if (!posted) throw Error(StatusCode::kShutdown, "the ucx engine is shut down");
  if (hello.wait_for(timeout) != std::future_status::ready) {
    post([this, conn] {
      close_conn(conn, Status(StatusCode::kTimeout, "connect timed out"));
    });
    throw Error(StatusCode::kTimeout, "ucx peer at " + remote.session_id +
                                          " did not answer within " +
                                          std::to_string(timeout.count()) + " ms");
  }
  const Status st = hello.get();
  if (!st.is_ok()) {
    // Refused authentication stays kPermissionDenied: reconnecting will not help.
    const bool keep = st.code() == StatusCode::kShutdown ||
                      st.code() == StatusCode::kPermissionDenied;
    throw Error(keep ? st.code() : StatusCode::kPeerFailure,
                "cannot connect to ucx peer at " + remote.session_id + ": " + st.message());
  }
  return conn;
}

void UcxCore::on_challenge(const ChallengeHdr& h) {
  auto it = conns_.find(h.conn_id);
  if (it == conns_.end()) return;
  auto conn = it->second;
  if (conn->hello_set || conn->closing || conn->owner_proved) return;
  if (options_.auth_token.empty()) {
    close_conn(conn, Status(StatusCode::kPermissionDenied,
                            "the owner requires an auth_token and this engine has none "
                            "(EngineOptions.extra[\"auth_token\"], --token-file)"));
    return;
  }
  Nonce nonce_o;
  std::memcpy(nonce_o.data(), h.nonce, kNonceBytes);
  if (!proof_matches(owner_proof(options_.auth_token, conn->nonce_r, nonce_o), h.mac)) {
    close_conn(conn, Status(StatusCode::kPermissionDenied,
                            "the owner's proof of the auth_token is wrong (the tokens "
                            "differ, or this is not the owner the descriptor names)"));
    return;
  }
  conn->owner_proved = true;
  AuthHdr a{};
  a.conn_id = conn->id;
  const Mac mac = reader_proof(options_.auth_token, conn->nonce_r, nonce_o);
  std::memcpy(a.mac, mac.data(), kMacBytes);
  send_small(conn->ep, kAmAuth, &a, sizeof a, nullptr, 0, true);
}

void UcxCore::hello_reply(const HelloHdr& h, const std::vector<std::uint8_t>& bytes) {
  auto it = conns_.find(h.conn_id);
  if (it == conns_.end()) return;
  auto conn = it->second;
  if (conn->hello_set || conn->closing) return;
  if (h.code != 0) {
    close_conn(conn, Status(StatusCode::kPermissionDenied,
                            "the owner refused this reader: " +
                                std::string(reinterpret_cast<const char*>(bytes.data()),
                                            std::min<std::size_t>(bytes.size(), 256))));
    return;
  }
  if (!options_.auth_token.empty() && !conn->owner_proved) {
    close_conn(conn, Status(StatusCode::kPermissionDenied,
                            "this engine has an auth_token but the owner did not prove it "
                            "(the owner has no auth_token)"));
    return;
  }
  conn->ticket = h.ticket;
  std::vector<std::uint8_t> address;
  try {
    std::uint32_t n = 0;
    if (bytes.size() < 4) throw Error(StatusCode::kCorruptDescriptor, "hello reply truncated");
    std::memcpy(&n, bytes.data(), 4);
    if (n > bytes.size() - 4) {
      throw Error(StatusCode::kCorruptDescriptor, "hello reply region length " +
                                                      std::to_string(n) + " exceeds " +
                                                      std::to_string(bytes.size() - 4));
    }
    conn->served = rma::RmaRegionInfo::decode(
        std::span<const std::uint8_t>(bytes.data() + 4, n));
    address.assign(bytes.begin() + 4 + n, bytes.end());
  } catch (const Error& e) {
    close_conn(conn, Status(StatusCode::kCorruptDescriptor,
                            std::string("the peer's region is malformed: ") + e.what()));
    return;
  }
  conn->mode = Mode::kAm;
  if (!address.empty() && options_.mode != Mode::kAm) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    // No peer error handling on this endpoint: UCX 1.13's shared-memory
    // transports other than cma cannot provide it, and asking for it makes
    // UCX fall back to tcp. Peer failure is detected on the control
    // endpoint (tcp, peer error handling), which then closes this one.
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ucs_status_t st = ucp_ep_create(worker_, &ep, &conn->data_ep);
    if (st != UCS_OK) conn->data_ep = nullptr;
    EpInfo info;
    if (conn->data_ep != nullptr) info = inspect_ep(conn->data_ep);
    const bool get = conn->data_ep != nullptr &&
                     (options_.mode == Mode::kGet ||
                      (options_.mode == Mode::kAuto && info.nic_rma));
    if (options_.mode == Mode::kGet && !get) {
      close_conn(conn, Status(StatusCode::kUnavailable,
                              "ucx_mode=get, but no endpoint to the peer's worker address: " +
                                  ucs_str(st)));
      return;
    }
    if (get) {
      st = ucp_ep_rkey_unpack(conn->data_ep, conn->served.backend_blob.data(), &conn->rkey);
      if (st != UCS_OK) {
        conn->rkey = nullptr;
        close_conn(conn, Status(StatusCode::kPermissionDenied,
                                "the peer's remote key does not unpack: " + ucs_str(st)));
        return;
      }
      conn->mode = Mode::kGet;
    } else if (conn->data_ep != nullptr && info.shm_am && options_.mode == Mode::kAmShm) {
      conn->am_on_data = true;
    } else if (conn->data_ep != nullptr) {
      // Nothing better than the control endpoint: am reads go over it.
      close_ep(conn->data_ep, nullptr, nullptr);
      conn->data_ep = nullptr;
    }
    if (conn->data_ep != nullptr) {
      // Finish the endpoint's wireup before the first read, within the
      // connect timeout: reads never wait behind a wireup that a dying peer
      // leaves hanging.
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      rp.cb.send = [](void* req, ucs_status_t s2, void* ud) {
        auto* tag = static_cast<ReqCtx*>(ud);
        tag->core->deferred_.push_back(
            [core = tag->core, id = tag->batch_id, s2] { core->data_ep_ready(id, s2); });
        delete tag;
        ucp_request_free(req);
      };
      rp.user_data = new ReqCtx{this, conn->id, {}};
      ucs_status_ptr_t sp = ucp_ep_flush_nbx(conn->data_ep, &rp);
      if (!UCS_PTR_IS_PTR(sp)) {
        delete static_cast<ReqCtx*>(rp.user_data);
        data_ep_ready(conn->id, UCS_PTR_STATUS(sp));
      }
      return;
    }
  } else if (options_.mode == Mode::kGet && address.empty()) {
    close_conn(conn, Status(StatusCode::kUnavailable,
                            "ucx_mode=get, but the peer sent no worker address"));
    return;
  }
  conn->hello_set = true;
  conn->hello.set_value(Status::ok());
}

UcxCore::EpInfo UcxCore::inspect_ep(ucp_ep_h ep) {
  // UCX 1.13 cannot be asked "is RMA native on this endpoint" (ucp_ep_query
  // reports names and addresses only), but its configuration dump names the
  // transport and the roles of every lane. Measured here (protocol v1, the
  // default of 1.13): ucp_get_nbx is a software emulation over active
  // messages on tcp and also on shared memory (posix/sysv can only map
  // memory UCX allocated itself; cma serves rendezvous, not gets), so gets
  // are only chosen for RDMA lanes; on shared memory the owner's
  // active-message replies (rendezvous over cma) are the fast path.
  EpInfo out;
  char* buf = nullptr;
  std::size_t size = 0;
  FILE* f = ::open_memstream(&buf, &size);
  if (f == nullptr) return out;
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  const std::string info(buf, size);
  std::free(buf);
  if (std::getenv("MSTAR_KV_UCX_DEBUG")) std::fprintf(stderr, "%s\n", info.c_str());
  std::size_t start = 0;
  while (start < info.size()) {
    std::size_t end = info.find('\n', start);
    if (end == std::string::npos) end = info.size();
    const std::string line = info.substr(start, end - start) + " ";
    start = end + 1;
    if (line.find("lane[") == std::string::npos) continue;
    const bool tcp = line.find("tcp") != std::string::npos;
    const bool shm = line.find("sysv") != std::string::npos ||
                     line.find("posix") != std::string::npos ||
                     line.find("xpmem") != std::string::npos;
    const bool rdma = line.find("rc_") != std::string::npos ||
                      line.find("dc_") != std::string::npos ||
                      line.find("rc/") != std::string::npos ||
                      line.find("dc/") != std::string::npos;
    if (rdma && line.find(" rma") != std::string::npos) out.nic_rma = true;
    if (shm && !tcp && line.find(" am ") != std::string::npos) out.shm_am = true;
  }
  return out;
}

void UcxCore::data_ep_ready(std::uint64_t conn_id, ucs_status_t st) {
  auto it = conns_.find(conn_id);
  if (it == conns_.end()) return;
  auto conn = it->second;
  if (conn->hello_set || conn->closing) return;
  if (st != UCS_OK) {
    close_conn(conn, Status(StatusCode::kPeerFailure,
                            "wireup of the data endpoint failed: " + ucs_str(st)));
    return;
  }
  conn->hello_set = true;
  conn->hello.set_value(Status::ok());
}

void UcxCore::on_client_ep_error(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* conn = static_cast<Conn*>(arg);
  UcxCore* self = conn->core;
  conn->failed.store(true, std::memory_order_release);
  const std::uint64_t id = conn->id;
  self->deferred_.push_back([self, id, st] {
    auto it = self->conns_.find(id);
    if (it == self->conns_.end()) return;
    self->close_conn(it->second,
                     Status(StatusCode::kPeerFailure, "peer failed: " + ucs_str(st)), true);
  });
}

void UcxCore::close_conn(std::shared_ptr<Conn> c, const Status& why, bool force) {
  if (c->closing) return;
  c->closing = true;
  c->failed.store(true, std::memory_order_release);
  // A forced close purges every request on the endpoint: their callbacks
  // run (with an error) before the close completes.
  if (c->ep) close_ep(c->ep, nullptr, c);
  c->ep = nullptr;
  // Requests still in flight keep the data endpoint open until they
  // complete (maybe_finish closes it): UCX 1.13 does not reliably purge
  // requests queued on an endpoint without peer error handling.
  bool gets_in_flight = false;
  for (std::uint64_t id : c->batches) {
    auto it = batches_.find(id);
    if (it != batches_.end() && it->second->outstanding != 0) gets_in_flight = true;
  }
  if (c->data_ep && (force || !gets_in_flight)) {
    close_ep(c->data_ep, c->rkey, c);
    c->data_ep = nullptr;
    c->rkey = nullptr;
    if (gets_in_flight) {
      // Written off: gets and rendezvous receives over shared memory or tcp
      // are executed by this thread inside UCX calls on that endpoint
      // (process_vm_readv / memcpy / socket reads), and the endpoint is
      // gone, so what UCX left uncompleted can no longer write. (UCX 1.13
      // leaves such requests of a dead owner uncompleted.)
      for (std::uint64_t id : c->batches) {
        auto it = batches_.find(id);
        if (it != batches_.end()) it->second->outstanding = 0;
      }
    }
  }
  conns_.erase(c->id);
  if (!c->hello_set) {
    c->hello_set = true;
    c->hello.set_value(why);
  }
  std::vector<std::uint64_t> ids(c->batches.begin(), c->batches.end());
  for (std::uint64_t id : ids) {
    auto it = batches_.find(id);
    if (it == batches_.end()) continue;
    auto b = it->second;  // a copy: finishing erases the map entry
    fail_batch(b,
               Status(why.code() == StatusCode::kShutdown ? StatusCode::kShutdown
                                                          : StatusCode::kPeerFailure,
                      "connection to " + c->session_id + " closed: " + why.message()));
  }
}

void UcxCore::close_ep(ucp_ep_h ep, ucp_rkey_h rkey, std::shared_ptr<Conn> keep) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &rp);
  if (UCS_PTR_IS_PTR(sp)) {
    closing_.push_back({sp, rkey, std::move(keep)});
  } else if (rkey) {
    ucp_rkey_destroy(rkey);
  }
}

void UcxCore::fail_batch(std::shared_ptr<Batch> b, Status st) {
  if (!b->failure) b->failure = std::move(st);
  maybe_finish(b);
}

void UcxCore::send_epoch_check(const std::shared_ptr<Batch>& b) {
  const auto& c = b->conn;
  const ReadReqHdr hdr{b->id, c->served.generation, 0, kReqCheckOnly, b->check.epoch,
                       b->check.pages.size(), c->ticket};
  send_small(c->ep, kAmReadReq, &hdr, sizeof hdr, b->check.pages.data(),
             b->check.pages.size() * sizeof(std::uint32_t), true);
}

void UcxCore::on_fin(const std::shared_ptr<Batch>& b, const Status& st) {
  if (b->aborted || b->failure) return;
  if (!st.is_ok()) {
    fail_batch(b, st);
    return;
  }
  if (!b->get) {
    b->fin = true;
  } else if (b->get_phase == 0) {
    b->get_phase = 1;
    post_gets(b);
  } else if (b->get_phase == 2) {
    b->get_phase = 3;
  }
  maybe_finish(b);
}

void UcxCore::maybe_finish(std::shared_ptr<Batch> b) {
  if (b->outstanding != 0) return;
  const bool stopped = b->aborted || b->failure.has_value();
  if (!stopped && !b->pending.empty()) return;
  if (!stopped && b->gather && b->got_count < b->chunks.size()) return;
  if (!stopped && b->get && b->next_chunk < b->chunks.size()) return;
  if (!stopped && b->check.epoch != 0) {
    if (!b->get && !b->fin) return;  // the owner's after-send check is to come
    if (b->get && b->get_phase < 2) {
      if (b->get_phase == 1) {  // every get landed: ask again
        b->get_phase = 2;
        send_epoch_check(b);
      }
      return;
    }
    if (b->get && b->get_phase == 2) return;
  }
  if (batches_.erase(b->id) == 0) return;  // finished already
  const auto& c = b->conn;
  c->batches.erase(b->id);
  if (c->closing && c->batches.empty() && c->data_ep != nullptr) {
    // The last get on a closed connection drained: now its endpoint goes.
    close_ep(c->data_ep, c->rkey, c);
    c->data_ep = nullptr;
    c->rkey = nullptr;
  }
  Status st = b->failure  ? *b->failure
              : b->aborted ? Status(StatusCode::kCancelled, "aborted")
                           : Status::ok();
  auto done = std::move(b->done);
  if (done) done(std::move(st));
}

void UcxCore::request_finished(std::uint64_t batch_id, ucs_status_t st) {
  auto it = batches_.find(batch_id);
  if (it == batches_.end()) return;
  auto b = it->second;
  if (b->outstanding > 0) --b->outstanding;
  if (st != UCS_OK && !b->failure && !b->aborted) {
    b->failure = Status(StatusCode::kPeerFailure, "ucx request failed: " + ucs_str(st));
  }
  if (b->get) post_gets(b);
  maybe_finish(b);
}

void UcxCore::post_gets(const std::shared_ptr<Batch>& b) {
  const auto& c = b->conn;
  while (b->outstanding < kGetWindow && b->next_chunk < b->chunks.size() && !b->aborted &&
         !b->failure && c->data_ep != nullptr && !c->closing) {
    const rma::RmaRead& r = b->chunks[b->next_chunk++];
    auto* ctx = new_ctx(b->id);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_MEMH;
    rp.cb.send = &UcxCore::on_req_done;
    rp.user_data = ctx;
    rp.memh = memh_;
    ucs_status_ptr_t sp = ucp_get_nbx(c->data_ep, cache_->base() + r.local_offset, r.length,
                                      c->served.data_ptr + r.remote_offset, c->rkey, &rp);
    if (UCS_PTR_IS_PTR(sp)) {
      ++b->outstanding;
      continue;
    }
    free_ctx(ctx);
    if (UCS_PTR_IS_ERR(sp)) {
      b->failure = Status(StatusCode::kPeerFailure,
                          "ucp_get_nbx: " + ucs_str(UCS_PTR_STATUS(sp)));
    }
  }
}

void UcxCore::on_req_done(void* request, ucs_status_t st, void* user_data) {
  auto* ctx = static_cast<ReqCtx*>(user_data);
  UcxCore* core = ctx->core;
  const std::uint64_t id = ctx->batch_id;
  core->free_ctx(ctx);
  core->request_finished(id, st);
  ucp_request_free(request);
}

void UcxCore::on_recv_done(void* request, ucs_status_t st, std::size_t, void* user_data) {
  on_req_done(request, st, user_data);
}

void UcxCore::start_batch(const std::shared_ptr<Batch>& b) {
  const auto& c = b->conn;
  batches_[b->id] = b;
  if (c->closing || c->ep == nullptr) {
    fail_batch(b, Status(StatusCode::kPeerFailure,
                         "connection to " + c->session_id + " is closed"));
    return;
  }
  c->batches.insert(b->id);
  if (c->mode == Mode::kGet) {
    b->get = true;
    if (b->check.epoch != 0) {  // the gets wait for the owner's first check
      b->get_phase = 0;
      send_epoch_check(b);
      return;
    }
    post_gets(b);
    maybe_finish(b);
    return;
  }
  std::vector<WireSpan> spans;
  spans.reserve(b->chunks.size());
  std::uint64_t total = 0;
  for (const rma::RmaRead& r : b->chunks) {
    spans.push_back({r.remote_offset, r.length, r.local_offset});
    total += r.length;
  }
  // Many small spans (rows of a layout change): gathered replies.
  b->gather = spans.size() >= kGatherMinSpans && total / spans.size() < kGatherBelowBytes;
  if (b->gather) {
    b->got.assign(spans.size(), 0);
  } else {
    for (const rma::RmaRead& r : b->chunks) b->pending.emplace(r.local_offset, r.length);
  }
  const std::uint64_t flags =
      (c->am_on_data ? kReqEagerOnly : 0) | (b->gather ? kReqGather : 0);
  const ReadReqHdr hdr{b->id, c->served.generation, spans.size(), flags, b->check.epoch,
                       b->check.pages.size(), c->ticket};
  std::vector<std::uint8_t> body(spans.size() * sizeof(WireSpan) +
                                 b->check.pages.size() * sizeof(std::uint32_t));
  std::memcpy(body.data(), spans.data(), spans.size() * sizeof(WireSpan));
  if (!b->check.pages.empty()) {
    std::memcpy(body.data() + spans.size() * sizeof(WireSpan), b->check.pages.data(),
                b->check.pages.size() * sizeof(std::uint32_t));
  }
  send_small(c->am_on_data ? c->data_ep : c->ep, kAmReadReq, &hdr, sizeof hdr, body.data(),
             body.size(), true);
}

void UcxCore::abort_batch(std::uint64_t id) {
  auto it = batches_.find(id);
  if (it == batches_.end()) return;
  auto b = it->second;
  b->aborted = true;
  // Stop posting (gets) and drop data still to arrive (am). Requests that
  // write into local pages (at most kGetWindow gets, or rendezvous
  // receives already started) complete by themselves and the read resolves
  // when the last one has; if they have not after kDrainGrace (a hung
  // owner), the progress loop closes the connection by force.
  if (b->outstanding != 0) {
    b->drain_deadline = std::chrono::steady_clock::now() + kDrainGrace;
    draining_.insert(b->id);
  }
  maybe_finish(b);
}

// ---------------------------------------------------------------------------
// RmaPeer / RmaOperation / RmaBackend
// ---------------------------------------------------------------------------

namespace {

class UcxOperation final : public rma::RmaOperation {
 public:
  UcxOperation(std::weak_ptr<UcxCore> core, std::uint64_t id)
      : core_(std::move(core)), id_(id) {}
  void abort() noexcept override {
    if (auto core = core_.lock()) {
      UcxCore* c = core.get();
      const std::uint64_t id = id_;
      try {
        c->post([c, id] { c->abort_batch(id); });
      } catch (...) {
        // Out of memory queuing the abort: the timeout or shutdown retries.
      }
    }
  }

 private:
  std::weak_ptr<UcxCore> core_;
  std::uint64_t id_;
};

class UcxPeer final : public rma::RmaPeer {
 public:
  UcxPeer(std::shared_ptr<UcxCore> core, std::shared_ptr<Conn> conn)
      : core_(std::move(core)), conn_(std::move(conn)) {}
  ~UcxPeer() override {
    UcxCore* c = core_.get();
    auto conn = conn_;
    c->post([c, conn] { c->close_conn(conn, Status(StatusCode::kCancelled, "released")); });
  }

  void verify(const rma::RmaRegionInfo& claimed) const override {
    rma::verify_region(conn_->served, claimed);
  }
  bool failed() const noexcept override {
    return conn_->failed.load(std::memory_order_acquire);
  }
  void send_done(std::uint64_t seq_id, std::uint64_t epoch) override {
    UcxCore* c = core_.get();
    auto conn = conn_;
    if (!c->post([c, conn, seq_id, epoch] {
          if (!conn->closing && conn->ep != nullptr) c->send_done(conn, seq_id, epoch);
        })) {
      throw Error(StatusCode::kShutdown, "the ucx engine is shut down");
    }
  }
  std::shared_ptr<rma::RmaOperation> post_reads(std::vector<rma::RmaRead> reads,
                                                rma::RmaCompletion done,
                                                rma::RmaEpochCheck check) override {
    auto b = std::make_shared<Batch>();
    b->check = std::move(check);
    b->id = core_->next_batch.fetch_add(1, std::memory_order_relaxed);
    b->conn = conn_;
    b->done = std::move(done);
    b->chunks = split_spans(reads, core_->options().chunk_bytes);
    UcxCore* c = core_.get();
    if (!c->post([c, b] { c->start_batch(b); })) {
      throw Error(StatusCode::kShutdown, "the ucx engine is shut down");
    }
    return std::make_shared<UcxOperation>(core_, b->id);
  }

 private:
  std::shared_ptr<UcxCore> core_;
  std::shared_ptr<Conn> conn_;
};

}  // namespace

UcxOptions UcxOptions::parse(const EngineOptions& options) {
  UcxOptions o;
  for (const auto& [key, value] : options.extra) {
    if (key == "ucx_mode") {
      if (value == "auto") o.mode = Mode::kAuto;
      else if (value == "get") o.mode = Mode::kGet;
      else if (value == "am") o.mode = Mode::kAm;
      else if (value == "am_shm") o.mode = Mode::kAmShm;
      else throw Error(StatusCode::kInvalidArgument,
                       "ucx_mode '" + value + "' is not one of auto, get, am, am_shm");
    } else if (key == "ucx_am_proto") {
      if (value == "eager") o.rndv_bytes = ~std::uint64_t{0};
      else if (value == "rndv") o.rndv_bytes = 0;
      else if (value == "auto") o.rndv_bytes = 64u << 10;
      else throw Error(StatusCode::kInvalidArgument,
                       "ucx_am_proto '" + value + "' is not one of auto, eager, rndv");
    } else if (key == "ucx_chunk_bytes") {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || v < 4096 || v > (1ull << 30)) {
        throw Error(StatusCode::kInvalidArgument,
                    "ucx_chunk_bytes '" + value + "' is not in [4096, 2^30]");
      }
      o.chunk_bytes = v;
    } else if (key == auth::kTokenKey) {
      o.auth_token = auth::token_from(options.extra);
    } else if (key.rfind("ucx_", 0) == 0) {
      throw Error(StatusCode::kInvalidArgument,
                  "unknown UCX option '" + key + "' (known: ucx_mode, ucx_am_proto, "
                  "ucx_chunk_bytes)");
    }
    // Keys of other engines are ignored: one EngineOptions may serve several.
  }
  return o;
}

UcxBackend::UcxBackend(std::shared_ptr<KVCache> cache, const std::string& entity_id,
                       const std::string& session_id, const UcxOptions& options)
    : core_(std::make_shared<UcxCore>(std::move(cache), entity_id, session_id, options)) {}

UcxBackend::~UcxBackend() { shutdown(); }

rma::RmaRegionInfo UcxBackend::local_region() const { return core_->region(); }

std::shared_ptr<rma::RmaPeer> UcxBackend::connect(const rma::RmaRegionInfo& remote,
                                                  std::chrono::milliseconds timeout) {
  auto conn = core_->connect(remote, timeout);
  return std::make_shared<UcxPeer>(core_, std::move(conn));
}

void UcxBackend::shutdown() noexcept { core_->stop(); }

void UcxBackend::set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> handler) {
  core_->set_done_handler(std::move(handler));
}

}  // namespace mstar::kv::ucx
