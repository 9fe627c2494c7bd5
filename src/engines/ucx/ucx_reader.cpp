// Copyright mstar-kv authors.
//
// UcxReader, the reader's side (ucx_reader.hpp): connecting (the handshake and the data endpoint),
// peer failure and closing. Its reads are ucx_batch.cpp.
#include "ucx_reader.hpp"

#include <cstring>

#include "ucx_core.hpp"

namespace mstar::kv::ucx {

// ---- client side -----------------------------------------------------------

UcxReader::UcxReader(UcxCore& core) : UcxPart(core, core.cache(), core.options()) {}

std::shared_ptr<Conn> UcxReader::connect(const rma::RmaRegionInfo& remote,
                                         std::chrono::milliseconds timeout) {
  const HostPort hp = parse_host_port(remote.session_id);
  socklen_t len = 0;
  const sockaddr_storage ss = resolve(hp, &len);
  auto conn = std::make_shared<Conn>();
  conn->core = &core_;
  conn->session_id = remote.session_id;
  std::future<Status> hello = conn->hello.get_future();
  const bool posted = core_.progress().post([this, conn, ss, len] {
    conn->id = next_conn_++;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    ep.sockaddr.addrlen = len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = trampoline<&UcxReader::on_client_ep_error, ConnGuard>;
    ep.err_handler.arg = conn.get();
    ucp_ep_h h = nullptr;
    const ucs_status_t st = ucp_ep_create(core_.worker().get(), &ep, &h);
    if (st == UCS_OK) conn->ep = Endpoint(h);
    if (st != UCS_OK) {
      close_conn(conn, Status(StatusCode::kPeerFailure, "ucp_ep_create: " + ucs_str(st)));
      return;
    }
    conns_[conn->id] = conn;
    HelloHdr hdr{};
    hdr.conn_id = conn->id;
    hdr.flags = options_.auth_token.empty() ? 0 : kHelloHasToken;
    conn->nonce_r = new_nonce();
    std::memcpy(hdr.nonce, conn->nonce_r.data(), kNonceBytes);
    core_.worker().send_small(conn->ep.get(), kAmHello, &hdr, sizeof hdr, nullptr, 0, true,
                              conn->id);
  });
  if (!posted) throw Error(StatusCode::kShutdown, "the ucx engine is shut down");
  if (hello.wait_for(timeout) != std::future_status::ready) {
    core_.progress().post(
        [this, conn] { close_conn(conn, Status(StatusCode::kTimeout, "connect timed out")); });
    throw Error(StatusCode::kTimeout, "ucx peer at " + remote.session_id +
                                          " did not answer within " +
                                          std::to_string(timeout.count()) + " ms");
  }
  const Status st = hello.get();
  if (!st.is_ok()) {
    // Refused authentication stays kPermissionDenied, a read mode the owner
    // does not serve kUnavailable (ucx_mode=get): reconnecting will not help.
    const bool keep = st.code() == StatusCode::kShutdown ||
                      st.code() == StatusCode::kPermissionDenied ||
                      st.code() == StatusCode::kUnavailable;
    throw Error(keep ? st.code() : StatusCode::kPeerFailure,
                "cannot connect to ucx peer at " + remote.session_id + ": " + st.message());
  }
  return conn;
}

void UcxReader::on_challenge(const ChallengeHdr& h) {
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
  core_.worker().send_small(conn->ep.get(), kAmAuth, &a, sizeof a, nullptr, 0, true, conn->id);
}

void UcxReader::hello_reply(const HelloHdr& h, const std::vector<std::uint8_t>& bytes) {
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
      throw Error(StatusCode::kCorruptDescriptor, "hello reply region length " + std::to_string(n) +
                                                      " exceeds " +
                                                      std::to_string(bytes.size() - 4));
    }
    conn->served = rma::RmaRegionInfo::decode(std::span<const std::uint8_t>(bytes.data() + 4, n));
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
    ucp_ep_h data_ep = nullptr;
    ucs_status_t st = ucp_ep_create(core_.worker().get(), &ep, &data_ep);
    if (st == UCS_OK) conn->data_ep = Endpoint(data_ep);
    EpInfo info;
    if (conn->data_ep) info = inspect_ep(conn->data_ep.get());
    // A staged cache is never the target of a get (ucx_staging); an owner
    // that publishes no remote keys serves none (ucx_emulated_gets).
    const bool served_keys = !conn->served.backend_blob.empty();
    const bool get =
        !core_.staging().active() && conn->data_ep && served_keys &&
        (options_.mode == Mode::kGet || (options_.mode == Mode::kAuto && info.nic_rma));
    if (options_.mode == Mode::kGet && conn->data_ep && !served_keys) {
      close_conn(conn, Status(StatusCode::kUnavailable,
                              "ucx_mode=get, but the owner serves no gets: it has no RDMA "
                              "transport, where UCX emulates gets with active messages and a "
                              "reader that dies mid-get can abort or stall the owner (the "
                              "owner's ucx_emulated_gets=on allows them)"));
      return;
    }
    if (options_.mode == Mode::kGet && !get) {
      close_conn(conn, Status(StatusCode::kUnavailable,
                              "ucx_mode=get, but no endpoint to the peer's worker address: " +
                                  ucs_str(st)));
      return;
    }
    if (get) {
      // One key per region of the owner (a cache of one region per layer).
      std::vector<std::span<const std::uint8_t>> keys;
      try {
        keys = conn->served.layer_regions.empty()
                   ? std::vector<std::span<const std::uint8_t>>{conn->served.backend_blob}
                   : unpack_rkeys(conn->served.backend_blob, conn->served.layer_regions.size());
      } catch (const Error& e) {
        close_conn(conn, e.status());
        return;
      }
      for (std::size_t i = 0; i < keys.size() && st == UCS_OK; ++i) {
        ucp_rkey_h rkey = nullptr;
        st = ucp_ep_rkey_unpack(conn->data_ep.get(), keys[i].data(), &rkey);
        if (st == UCS_OK) conn->rkeys.emplace_back(rkey);
      }
      if (st != UCS_OK) {
        close_conn(conn, Status(StatusCode::kPermissionDenied,
                                "the peer's remote key does not unpack: " + ucs_str(st)));
        return;
      }
      conn->remote = conn->served.region_map();
      conn->mode = Mode::kGet;
    } else if (conn->data_ep && info.shm_am && options_.mode == Mode::kAmShm) {
      conn->am_on_data = true;
    } else if (conn->data_ep) {
      // Nothing better than the control endpoint: am reads go over it.
      core_.worker().close_ep(std::move(conn->data_ep), {}, nullptr);
    }
    if (conn->data_ep) {
      // Finish the endpoint's wireup before the first read, within the
      // connect timeout: reads never wait behind a wireup that a dying peer
      // leaves hanging.
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      auto flush = std::make_unique<Control>();
      flush->core = &core_;
      flush->conn_id = conn->id;
      Control* ctx = core_.worker().control_requests().add(std::move(flush));
      rp.cb.send = trampoline<&UcxReader::on_data_ep_flushed, RequestGuard>;
      rp.user_data = static_cast<Pending*>(ctx);
      ucs_status_ptr_t sp = ucp_ep_flush_nbx(conn->data_ep.get(), &rp);
      if (!UCS_PTR_IS_PTR(sp)) {
        core_.worker().control_requests().take(ctx);
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

UcxReader::EpInfo UcxReader::inspect_ep(ucp_ep_h ep) {
  // UCX 1.13 cannot be asked "is RMA native on this endpoint" (ucp_ep_query
  // reports names and addresses only), but its configuration dump names the
  // transport and the roles of every lane. Measured here (protocol v1, the
  // default of 1.13): ucp_get_nbx is a software emulation over active
  // messages on tcp and also on shared memory (posix/sysv can only map
  // memory UCX allocated itself; cma serves rendezvous, not gets), so gets
  // are only chosen for RDMA lanes; on shared memory the owner's
  // active-message replies (rendezvous over cma) are the fast path.
  EpInfo out;
  const bool debug = std::getenv("MSTAR_KV_UCX_DEBUG") != nullptr;
  for (std::string line : printed_lines([ep](FILE* f) { ucp_ep_print_info(ep, f); })) {
    if (debug) std::fprintf(stderr, "%s\n", line.c_str());
    line += ' ';
    if (line.find("lane[") == std::string::npos) continue;
    const bool tcp = line.find("tcp") != std::string::npos;
    const bool shm = line.find("sysv") != std::string::npos ||
                     line.find("posix") != std::string::npos ||
                     line.find("xpmem") != std::string::npos;
    const bool rdma =
        line.find("rc_") != std::string::npos || line.find("dc_") != std::string::npos ||
        line.find("rc/") != std::string::npos || line.find("dc/") != std::string::npos;
    if (rdma && line.find(" rma") != std::string::npos) out.nic_rma = true;
    if (shm && !tcp && line.find(" am ") != std::string::npos) out.shm_am = true;
  }
  return out;
}

void UcxReader::data_ep_ready(std::uint64_t conn_id, ucs_status_t st) {
  auto it = conns_.find(conn_id);
  if (it == conns_.end()) return;
  auto conn = it->second;
  if (conn->hello_set || conn->closing) return;
  if (st != UCS_OK) {
    close_conn(conn, Status(StatusCode::kPeerFailure,
                            "wireup of the data endpoint failed: " + ucs_str(st)));
    return;
  }
  if (conn->am_on_data && !conn->bound) {
    // Wired up: bind it for the owner's replies; connected once the owner
    // answers on it (on_bound), within the connect timeout. The requests go
    // on the control endpoint (ucx_wire.hpp, BindHdr).
    if (!conn->bind_sent) {
      conn->bind_sent = true;
      const BindHdr b{conn->id, conn->ticket};
      core_.worker().send_small(conn->data_ep.get(), kAmBind, &b, sizeof b, nullptr, 0, true,
                                conn->id);
    }
    return;
  }
  conn->hello_set = true;
  conn->hello.set_value(Status::ok());
}

void UcxReader::on_bound(const BindHdr& h) {
  auto it = conns_.find(h.conn_id);
  if (it == conns_.end()) return;
  const auto& conn = it->second;
  // Only the answer to this connection's own bind counts.
  if (!conn->bind_sent || conn->bound || h.ticket != conn->ticket) return;
  conn->bound = true;
  data_ep_ready(conn->id, UCS_OK);
}

void UcxReader::on_data_ep_flushed(void* req, ucs_status_t st, void* ud) {
  const Request freed(req);
  auto* c = context_of<Control>(ud);
  UcxCore* core = c->core;
  const std::uint64_t id = c->conn_id;
  core->worker().control_requests().take(c);
  UcxReader& self = core->reader();
  core->progress().defer([&self, id, st] { self.data_ep_ready(id, st); });
}

void UcxReader::on_client_ep_error(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* conn = static_cast<Conn*>(arg);
  UcxReader* self = &conn->core->reader();
  conn->failed.store(true, std::memory_order_release);
  const std::uint64_t id = conn->id;
  self->core_.progress().defer([self, id, st] {
    auto it = self->conns_.find(id);
    if (it == self->conns_.end()) return;
    self->close_conn(it->second, Status(StatusCode::kPeerFailure, "peer failed: " + ucs_str(st)),
                     true);
  });
}

void UcxReader::message_failed(std::uint64_t conn, unsigned id, ucs_status_t st) {
  // After this progress round: the failing send may be inside one of our
  // own calls (start_batch) or inside a close that purges the endpoint.
  core_.progress().defer([this, conn, id, st] {
    auto it = conns_.find(conn);
    if (it == conns_.end()) return;  // closed already (a purge by our own close)
    core_.trace("conn %llu: message %u to %s failed: %s", static_cast<unsigned long long>(conn), id,
                it->second->session_id.c_str(), ucs_status_string(st));
    close_conn(it->second,
               Status(StatusCode::kPeerFailure, "a message to the owner failed: " + ucs_str(st)),
               true);
  });
}

void UcxReader::check_peers() {
  using Clock = std::chrono::steady_clock;
  const auto timeout = options_.peer_timeout;
  const auto now = Clock::now();
  if (timeout.count() == 0 || now - peers_checked_ < std::chrono::milliseconds(20)) return;
  peers_checked_ = now;
  const auto ping_every = timeout / 4;
  std::vector<std::shared_ptr<Conn>> silent;
  for (auto& [id, c] : conns_) {
    if (c->batches.empty() || c->closing || !c->hello_set || !c->ep) continue;
    const auto quiet = now - c->heard;
    if (quiet >= timeout) {
      silent.push_back(c);
    } else if (quiet >= ping_every && now - c->pinged >= ping_every) {
      // A message the owner's progress thread answers at once, and one
      // more send on the connection: a peer whose socket is dead fails it.
      c->pinged = now;
      const PingHdr hdr{c->id, c->ticket};
      core_.trace("conn %llu: %s quiet for %lld ms, pinged", static_cast<unsigned long long>(c->id),
                  c->session_id.c_str(),
                  static_cast<long long>(
                      std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count()));
      core_.worker().send_small(c->ep.get(), kAmPing, &hdr, sizeof hdr, nullptr, 0, true, c->id);
    }
  }
  for (auto& c : silent) {
    core_.trace("conn %llu: %s silent for the peer timeout (%lld ms), closed",
                static_cast<unsigned long long>(c->id), c->session_id.c_str(),
                static_cast<long long>(timeout.count()));
    close_conn(
        c,
        Status(StatusCode::kPeerFailure, "the owner sent nothing and answered no ping for " +
                                             std::to_string(timeout.count()) +
                                             " ms (ucx_peer_timeout_ms): it is dead or hung"),
        true);
  }
}

void UcxReader::close_conn(std::shared_ptr<Conn> c, const Status& why, bool force) {
  if (c->closing) return;
  c->closing = true;
  c->failed.store(true, std::memory_order_release);
  // A forced close purges every request on the endpoint: their callbacks
  // run (with an error) before the close completes.
  if (c->ep) core_.worker().close_ep(std::move(c->ep), {}, c);
  // Requests still in flight keep the data endpoint open until they
  // complete (maybe_finish closes it): UCX 1.13 does not reliably purge
  // requests queued on an endpoint without peer error handling.
  bool gets_in_flight = false;
  for (std::uint64_t id : c->batches) {
    const std::shared_ptr<Batch> b = core_.reads().find(id);
    if (b && b->outstanding != 0) gets_in_flight = true;
  }
  if (c->data_ep && (force || !gets_in_flight)) {
    core_.worker().close_ep(std::move(c->data_ep), std::move(c->rkeys), c);
    if (gets_in_flight) {
      // Written off: gets and rendezvous receives over shared memory or tcp
      // are executed by this thread inside UCX calls on that endpoint
      // (process_vm_readv / memcpy / socket reads), and the endpoint is
      // gone, so what UCX left uncompleted can no longer write. (UCX 1.13
      // leaves such requests of a dead owner uncompleted.)
      for (std::uint64_t id : c->batches) {
        if (const std::shared_ptr<Batch> b = core_.reads().find(id)) b->outstanding = 0;
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
    auto b = core_.reads().find(id);  // a copy: finishing erases the map entry
    if (!b) continue;
    core_.reads().fail_batch(
        b, Status(why.code() == StatusCode::kShutdown ? StatusCode::kShutdown
                                                      : StatusCode::kPeerFailure,
                  "connection to " + c->session_id + " closed: " + why.message()));
  }
}

void UcxReader::close_all() {
  auto conns = conns_;
  for (auto& [id, c] : conns) {
    close_conn(c, Status(StatusCode::kShutdown, "the ucx engine shut down"), true);
  }
}

void UcxReader::send_done(const std::shared_ptr<Conn>& c, std::uint64_t seq_id,
                          std::uint64_t epoch) {
  const DoneHdr hdr{seq_id, epoch, c->served.generation, c->ticket};
  core_.worker().send_small(c->ep.get(), kAmDone, &hdr, sizeof hdr, nullptr, 0, true, c->id);
}

}  // namespace mstar::kv::ucx
