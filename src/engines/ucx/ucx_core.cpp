// Copyright mstar-kv authors.
//
// UcxCore: UCP set-up and release, the listener, the progress thread (ucx_core.hpp).
#include "ucx_core.hpp"

#include <pthread.h>

namespace mstar::kv::ucx {

std::vector<std::uint8_t> pack_rkeys(const std::vector<std::vector<std::uint8_t>>& keys) {
  std::vector<std::uint8_t> out;
  auto u32 = [&out](std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  };
  u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) {
    u32(static_cast<std::uint32_t>(k.size()));
    out.insert(out.end(), k.begin(), k.end());
  }
  return out;
}

std::vector<std::string> printed_lines(const std::function<void(FILE*)>& print) {
  char* buf = nullptr;
  std::size_t size = 0;
  FILE* f = ::open_memstream(&buf, &size);
  if (f == nullptr) return {};
  print(f);
  std::fclose(f);
  const std::string text(buf, size);
  std::free(buf);
  std::vector<std::string> lines;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// Whether the context has an RDMA transport (rc or dc), where gets are
// one-sided: UCX 1.13 cannot be asked, but its configuration dump lists each
// resource as "transport/device" (the lanes of an endpoint: inspect_ep).
static bool has_rdma(ucp_context_h context) {
  for (const std::string& line :
       printed_lines([context](FILE* f) { ucp_context_print_info(context, f); })) {
    if (line.find("resource") == std::string::npos) continue;
    if (line.find(" rc_") != std::string::npos || line.find(" dc_") != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::vector<std::span<const std::uint8_t>> unpack_rkeys(std::span<const std::uint8_t> blob,
                                                        std::size_t count) {
  std::size_t at = 0;
  auto u32 = [&](const char* what) {
    if (blob.size() - at < 4) {
      throw Error(StatusCode::kCorruptDescriptor,
                  std::string("the owner's remote keys end before ") + what);
    }
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{blob[at + i]} << (8 * i);
    at += 4;
    return v;
  };
  const std::uint32_t n = u32("their count");
  if (n != count) {
    throw Error(StatusCode::kCorruptDescriptor, "the owner's blob holds " + std::to_string(n) +
                                                    " remote keys for its " +
                                                    std::to_string(count) + " layer regions");
  }
  std::vector<std::span<const std::uint8_t>> keys;
  keys.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint32_t len = u32("a key's length");
    if (len == 0 || len > blob.size() - at) {
      throw Error(StatusCode::kCorruptDescriptor, "remote key " + std::to_string(i) + " of " +
                                                      std::to_string(len) +
                                                      " bytes does not fit the owner's blob");
    }
    keys.push_back(blob.subspan(at, len));
    at += len;
  }
  if (at != blob.size()) {
    throw Error(StatusCode::kCorruptDescriptor, "the owner's remote keys are followed by " +
                                                    std::to_string(blob.size() - at) +
                                                    " unexpected bytes");
  }
  return keys;
}

UcxCore::UcxCore(std::shared_ptr<KVCache> cache, const std::string& entity_id,
                 const std::string& session_id, const UcxOptions& options)
    : cache_(std::move(cache)), options_(options) {
  // Staging (ucx_staging): a device cache's bytes cross through host
  // buffers, copied by its memory's copier (the cuda_ipc copy kernel); a
  // host cache only when asked (tests, the cost of staging in the bench).
  if (cache_->memory_kind() == MemoryKind::kDevice) {
    if (options_.staging == Staging::kOff) {
      throw Error(StatusCode::kInvalidArgument,
                  "ucx_staging=off, but the cache is device memory: the ucx engine moves a "
                  "device cache only through host staging (ucx_staging=auto or on)");
    }
    copier_ = cache_->memory().staging_copier();
    if (!copier_) {
      throw Error(StatusCode::kUnavailable,
                  "the ucx engine moves a device cache through pinned host buffers with the "
                  "cuda_ipc engine's copy kernel, which this build lacks (no CUDA compiler, "
                  "or MSTAR_KV_CUDA_IPC_KERNEL=OFF)");
    }
  } else if (options_.staging == Staging::kOn) {
    copier_ = staging::host_copier();
  }
  if (copier_ && options_.mode == Mode::kGet) {
    throw Error(StatusCode::kInvalidArgument,
                "ucx_mode=get cannot fill a staged cache (ucx_staging): its bytes land through "
                "host buffers, never by a get into its pages");
  }
  region_.entity_id = entity_id;
  // A cache of one region per layer: each layer registered and published
  // on its own (one layer is one region).
  if (cache_->split() && cache_->num_regions() > 1) {
    layer_bytes_ = cache_->layout().layer_bytes();
    for (std::size_t l = 0; l < cache_->num_regions(); ++l) {
      region_.layer_regions.push_back(cache_->regions().base(l));
    }
  }
  region_.data_ptr = cache_->regions().base(0);
  region_.size = cache_->size_bytes();
  region_.layout = cache_->layout();
  region_.generation = rma::new_generation();
  init_ucp(session_id);  // on failure the handles release what was made
  thread_ = std::thread([this] { run(); });
}

void UcxCore::init_ucp(const std::string& session_id) {
  ucp_config_t* raw_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_config);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_config_read: " + ucs_str(st));
  const std::unique_ptr<ucp_config_t, decltype(&ucp_config_release)> config(raw_config,
                                                                            &ucp_config_release);
  // No zero-copy eager sends (unless UCX_ZCOPY_THRESH says otherwise): UCX
  // 1.13's tcp transport aborts the process (uct_iface.h:884, "comp->count
  // > 0") when a peer dies while an eager zero-copy send to it is in flight,
  // i.e. an owner died with a reader killed mid-reply (8 of 12 runs of
  // UcxDataPath.ReaderKilled... with ucx_am_proto=eager). Eager copies then
  // go through UCX's buffers; measured no slower (bench/README.md).
  if (std::getenv("UCX_ZCOPY_THRESH") == nullptr) {
    st = ucp_config_modify(config.get(), "ZCOPY_THRESH", "inf");
    if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_config_modify: " + ucs_str(st));
  }
  // TCP segments of 64 KiB instead of UCX's 8 KiB (unless UCX_TCP_TX_SEG_SIZE
  // / UCX_TCP_RX_SEG_SIZE say otherwise): replies cross as gathered
  // messages of up to 1 MiB, which UCX copies segment by segment (over
  // loopback the Llama-3-8B request 1.9-2.1 -> 3.1-3.7 GB/s; bench/README.md).
  // The keys without "TCP_": ucp_config_modify hands them to the transports.
  // A tuning only: a UCX that refuses the key keeps its own segment size.
  for (const char* key : {"TX_SEG_SIZE", "RX_SEG_SIZE"}) {
    if (std::getenv(("UCX_TCP_" + std::string(key)).c_str()) != nullptr) continue;
    const bool taken = ucp_config_modify(config.get(), key, "64k") == UCS_OK;
    if (!taken && std::getenv("MSTAR_KV_UCX_DEBUG") != nullptr) {
      std::fprintf(stderr, "mstar-kv ucx: UCX keeps its %s\n", key);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h ctx = nullptr;
  st = ucp_init(&params, config.get(), &ctx);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_init: " + ucs_str(st));
  context_ = Context(ctx);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  st = ucp_worker_create(context_.get(), &wp, &worker);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_worker_create: " + ucs_str(st));
  worker_ = Worker(worker);
  if (ucp_worker_get_efd(worker, &efd_) != UCS_OK) efd_ = -1;  // then poll busily

  rows_dt_ = RowDatatype::create_source();
  sink_dt_ = RowDatatype::create_sink();
  // One registration (and remote key) per region; none for device memory
  // (a UCX without CUDA cannot map it): it is only ever staged, so readers
  // get no worker address (no gets) and its pages are never sent from or
  // received into.
  std::vector<std::vector<std::uint8_t>> rkeys;
  const bool registered = cache_->memory_kind() != MemoryKind::kDevice;
  const std::size_t regions = region_.layer_regions.empty() ? 1 : region_.layer_regions.size();
  for (std::size_t i = 0; registered && i < regions; ++i) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = cache_->regions().pointer(i * layer_bytes_);
    mp.length = regions == 1 ? cache_->size_bytes() : layer_bytes_;
    ucp_mem_h memh = nullptr;
    st = ucp_mem_map(context_.get(), &mp, &memh);
    if (st != UCS_OK) {
      throw Error(StatusCode::kUnavailable,
                  "ucp_mem_map of " + std::to_string(mp.length) + " bytes" +
                      (regions == 1 ? std::string() : " (layer " + std::to_string(i) + ")") + ": " +
                      ucs_str(st));
    }
    memhs_.emplace_back(context_.get(), memh);
    void* rkey_buf = nullptr;
    std::size_t rkey_len = 0;
    st = ucp_rkey_pack(context_.get(), memh, &rkey_buf, &rkey_len);
    if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_rkey_pack: " + ucs_str(st));
    const std::unique_ptr<void, decltype(&ucp_rkey_buffer_release)> keep(rkey_buf,
                                                                         &ucp_rkey_buffer_release);
    rkeys.emplace_back(static_cast<std::uint8_t*>(rkey_buf),
                       static_cast<std::uint8_t*>(rkey_buf) + rkey_len);
  }
  // The remote keys (gets) only where gets are one-sided, or where the owner
  // allows emulated ones (ucx_emulated_gets): UCX 1.13 serves a get over tcp
  // or shared memory with active messages, and a reader killed mid-get
  // aborted the owner in ucp_get_req_handler over tcp ("unexpected error:
  // Endpoint timeout", 12 of 60 runs of a killed get reader) and, over
  // shared memory, stalled its receive fifo for every reader or crashed it
  // in ucp_worker_destroy (1 in 40-100 runs). Without them a get reader is
  // refused at connect (ucx_reader.cpp).
  if (registered && (options_.emulated_gets || has_rdma(context_.get()))) {
    region_.backend_blob = regions == 1 ? std::move(rkeys[0]) : pack_rkeys(rkeys);
  }
  if (region_.backend_blob.size() > rma::RmaRegionInfo::kMaxBlobBytes) {
    throw Error(StatusCode::kUnavailable,
                "the remote keys of the cache's " + std::to_string(regions) + " regions take " +
                    std::to_string(region_.backend_blob.size()) + " bytes, beyond a descriptor's " +
                    std::to_string(rma::RmaRegionInfo::kMaxBlobBytes));
  }

  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_worker_get_address: " + ucs_str(st));
  {
    auto release = [worker](ucp_address_t* a) { ucp_worker_release_address(worker, a); };
    const std::unique_ptr<ucp_address_t, decltype(release)> keep(addr, release);
    if (registered) {
      worker_address_.assign(reinterpret_cast<std::uint8_t*>(addr),
                             reinterpret_cast<std::uint8_t*>(addr) + addr_len);
    }
  }

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = trampoline<&UcxCore::on_am, AmGuard>;
  for (unsigned id : {kAmHello, kAmHelloReply, kAmReadReq, kAmReadData, kAmReadErr, kAmReadFin,
                      kAmDone, kAmChallenge, kAmAuth, kAmGatherData, kAmReadyReq, kAmReadyNotice}) {
    am_tags_[id] = AmTag{this, id};
    hp.id = id;
    hp.arg = &am_tags_[id];
    st = ucp_worker_set_am_recv_handler(worker, &hp);
    if (st != UCS_OK) {
      throw Error(StatusCode::kUnavailable, "ucp_worker_set_am_recv_handler: " + ucs_str(st));
    }
  }
  open_listener(session_id);
}

void UcxCore::open_listener(const std::string& session_id) {
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.conn_handler.cb = trampoline<&UcxCore::on_conn_request, CoreGuard>;
  lp.conn_handler.arg = this;
  auto try_open = [&](const HostPort& hp) {
    socklen_t len = 0;
    sockaddr_storage ss = resolve(hp, &len);
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = len;
    ucp_listener_h l = nullptr;
    const ucs_status_t st = ucp_listener_create(worker_.get(), &lp, &l);
    lp.sockaddr.addr = nullptr;  // ss is gone after this call; UCX copied it
    if (st == UCS_OK) listener_ = Listener(l);
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
  ucp_worker_signal(worker_.get());  // safe from any thread
  return true;
}

void UcxCore::drain_deferred() {
  while (!deferred_.empty()) {
    auto work = std::move(deferred_);
    deferred_.clear();
    for (auto& w : work) w();
  }
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
               Status(StatusCode::kCancelled, "gets of a stopped read did not drain in " +
                                                  std::to_string(kDrainGrace.count()) + " ms"),
               true);
  }
}

void UcxCore::reap_closing(bool force) {
  std::erase_if(closing_, [force](const Closing& c) { return force || done(c.request); });
}

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
    auto it = batches_.find(f.batch_id);
    if (f.batch_id != 0 && it != batches_.end()) {
      fail_batch(it->second,
                 Status(StatusCode::kInternal,
                        std::string("the ucx engine failed handling ") + f.what + ": " + why));
      return;
    }
  } catch (...) {
  }
  // Nothing of ours to fail (the owner's side, a handshake): the peer's
  // read or connect fails in its timeout.
  std::fprintf(stderr, "mstar-kv ucx: handling %s failed: %s\n", f.what, why.c_str());
}

void UcxCore::run() {
  // Named, so a profiler or /proc/PID/task shows which thread moves the bytes.
  pthread_setname_np(pthread_self(), "mstar-kv-ucx");
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
    while (unsigned n = ucp_worker_progress(worker_.get())) {
      progressed += n;
      drain_deferred();
    }
    drain_deferred();
    reap_closing(false);
    if (!draining_.empty()) check_drains();
    if (!staged_waits_.empty() || !staged_reads_.empty()) poll_staged();
    if (!ready_holds_.empty()) check_ready_holds();
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
      std::vector<ucp_ep_h> seps;
      for (const auto& [ep, owned] : server_eps_) seps.push_back(ep);
      for (ucp_ep_h ep : seps) close_server_ep(ep);
      listener_.reset();
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
    // Idle (ucx_progress): adaptive keeps polling (yielding the core: the
    // machine may be shared) while reads or data replies are in flight and
    // sleeps on the worker's event fd after 256 idle rounds otherwise; event
    // sleeps at once; busy never sleeps. An event sleep with transfers in
    // flight is 1 ms at most: shared-memory transports raise no event when
    // the peer frees room in a fifo or a get completes.
    const bool busy = !batches_.empty() || !sends_.empty() || !staged_waits_.empty();
    if (options_.progress == Progress::kBusy) continue;
    const bool event = options_.progress == Progress::kEvent;
    if (!ready_holds_.empty() && (event || idle >= 32)) {
      // Held readiness requests: the owner's pool marks layers with plain
      // stores (no event), so look again every 20 us.
      idle = 0;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      continue;
    }
    if (efd_ < 0) {  // no event fd: poll, resting 50 us per round once idle a while
      if (!busy && ++idle >= 256) std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::this_thread::yield();
      continue;
    }
    if (!event && (busy || ++idle < 256)) {
      std::this_thread::yield();
      continue;
    }
    idle = 0;
    if (ucp_worker_arm(worker_.get()) == UCS_ERR_BUSY) continue;
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
    ucp_worker_signal(worker_.get());
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
  server_eps_.clear();
  listener_.reset();
  memhs_.clear();
  worker_.reset();
  context_.reset();
  // Now nothing can complete or write any more.
  reads_.clear();
  sends_.clear();
  controls_.clear();
}

}  // namespace mstar::kv::ucx
