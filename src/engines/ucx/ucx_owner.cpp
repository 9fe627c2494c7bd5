// Copyright mstar-kv authors.
//
// UcxOwner, the owner's side: the listener, readers' connections and the
// handshake (ucx_owner.hpp; served reads: ucx_serve.cpp).
#include "ucx_owner.hpp"

#include <cstring>
#include <random>

#include "ucx_core.hpp"

namespace mstar::kv::ucx {

// ---- server side -----------------------------------------------------------

UcxOwner::UcxOwner(UcxCore& core, const std::string& session_id)
    : UcxPart(core, core.cache(), core.options()) {
  open_listener(session_id);
}

void UcxOwner::open_listener(const std::string& session_id) {
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.conn_handler.cb = trampoline<&UcxOwner::on_conn_request, CoreGuard>;
  lp.conn_handler.arg = &core_;
  auto try_open = [&](const HostPort& hp) {
    socklen_t len = 0;
    sockaddr_storage ss = resolve(hp, &len);
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = len;
    ucp_listener_h l = nullptr;
    const ucs_status_t st = ucp_listener_create(core_.worker().get(), &lp, &l);
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
    core_.worker().set_session(session_id);
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
      core_.worker().set_session(hp.host + ":" + std::to_string(hp.port));
      return;
    }
  }
  throw Error(StatusCode::kUnavailable,
              "no free port in 20000-29999 for the ucx listener: " + ucs_str(st));
}

void UcxOwner::on_conn_request(ucp_conn_request_h req, void* arg) {
  UcxOwner* self = &static_cast<UcxCore*>(arg)->owner();
  if (self->core_.progress().stopping()) {
    ucp_listener_reject(self->listener_.get(), req);
    return;
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = trampoline<&UcxOwner::on_server_ep_error, CoreGuard>;
  ep.err_handler.arg = &self->core_;
  ucp_ep_h h = nullptr;
  if (ucp_ep_create(self->core_.worker().get(), &ep, &h) != UCS_OK) return;
  Listened l{Endpoint(h), std::make_shared<ServedEp>()};  // closed again if it cannot be kept
  l.served->ep = h;
  self->server_eps_.emplace(h, std::move(l));
  self->counters_.connected.fetch_add(1, std::memory_order_relaxed);
}

void UcxOwner::on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  UcxOwner* self = &static_cast<UcxCore*>(arg)->owner();
  self->core_.progress().defer([self, ep] { self->close_server_ep(ep); });
}

void UcxOwner::close_server_ep(ucp_ep_h ep) {
  auto owned = server_eps_.find(ep);
  if (owned == server_eps_.end()) return;
  Endpoint closing = std::move(owned->second.owned);
  const Served served = std::move(owned->second.served);
  server_eps_.erase(owned);
  // From here on every reply that holds the record is dropped: the close
  // below destroys the endpoint at once (forced), UCX may still complete
  // its sends afterwards, and its address goes to the next endpoint.
  served->open = false;
  if (served->ticket != 0) tickets_.erase(served->ticket);  // its requests are refused now
  counters_.gone.fetch_add(1, std::memory_order_relaxed);
  core_.worker().close_ep(std::move(closing), {}, nullptr);
}

void UcxOwner::close_all() {
  std::vector<ucp_ep_h> seps;
  for (const auto& [ep, owned] : server_eps_) seps.push_back(ep);
  for (ucp_ep_h ep : seps) close_server_ep(ep);
  listener_.reset();
}

void UcxOwner::clear() noexcept {
  server_eps_.clear();
  listener_.reset();
}

Served UcxOwner::served_of(ucp_ep_h reply_ep) {
  // Requests come on listener endpoints only: a reader's data endpoint
  // (ucx_mode=am_shm) carries its bind and the owner's replies
  // (ucx_wire.hpp, BindHdr).
  if (auto it = server_eps_.find(reply_ep); it != server_eps_.end()) return it->second.served;
  return nullptr;
}

void UcxOwner::on_bind(ucp_ep_h reply_ep, const BindHdr& h) {
  // A listener endpoint is no data endpoint; a connection binds once.
  if (server_eps_.count(reply_ep) != 0) return;
  const auto c = tickets_.find(h.ticket);
  if (h.ticket == 0 || c == tickets_.end()) {
    counters_.refused.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const Served conn = c->second;
  if (!conn->open || conn->data_reply != nullptr) return;
  conn->data_reply = reply_ep;
  auto data = std::make_shared<ServedEp>();
  data->ep = reply_ep;
  data->conn = conn;
  core_.progress().defer([this, data, h] { reply(data, kAmBound, &h, sizeof h, nullptr, 0); });
}

void UcxOwner::reply(const Served& to, unsigned id, const void* header, std::size_t header_len,
                     const void* data, std::size_t data_len) {
  if (!to->usable()) {
    drop(1, id == kAmReadFin ? "an epoch verdict" : "a reply");
    return;
  }
  core_.worker().send_small(to->ep, id, header, header_len, data, data_len, false);
}

void UcxOwner::drop(std::uint64_t n, const char* what) {
  // Shutting down closes every connection: what it leaves unsent is no
  // reader's going away.
  if (core_.progress().stopping()) return;
  counters_.dropped.fetch_add(n, std::memory_order_relaxed);
  if (!drop_logged_.exchange(true, std::memory_order_relaxed)) {
    options_.log.warn(std::string("ucx owner: ") + what +
                      " for a reader whose connection closed was dropped (the reader went away "
                      "with reads in flight); later ones are counted, not logged "
                      "(stats: served replies_dropped)");
  }
}

ServedStats UcxOwner::served_stats() const noexcept {
  ServedStats s;
  s.reads = counters_.reads.load(std::memory_order_relaxed);
  s.bytes = counters_.bytes.load(std::memory_order_relaxed);
  s.reads_refused = counters_.refused.load(std::memory_order_relaxed);
  s.replies_dropped = counters_.dropped.load(std::memory_order_relaxed);
  s.readers_connected = counters_.connected.load(std::memory_order_relaxed);
  s.readers_gone = counters_.gone.load(std::memory_order_relaxed);
  s.staged_bytes = counters_.staged.load(std::memory_order_relaxed);
  return s;
}

void UcxOwner::on_hello(const Served& to, const HelloHdr& h) {
  if (to->conn || !to->open || to->refused || to->challenge || to->ticket != 0) {
    return;  // one handshake per listener endpoint
  }
  if (options_.auth_token.empty()) {
    serve_hello(to, h.conn_id);
    return;
  }
  // Prove the secret first (mutual authentication), over the reader's nonce
  // and a fresh one of ours; the region goes out only after the reader's
  // proof (on_auth). A reader without a token learns it needs one.
  Nonce nonce_r;
  std::memcpy(nonce_r.data(), h.nonce, kNonceBytes);
  const Nonce nonce_o = new_nonce();
  to->challenge = std::pair{nonce_r, nonce_o};
  ChallengeHdr c{};
  c.conn_id = h.conn_id;
  std::memcpy(c.nonce, nonce_o.data(), kNonceBytes);
  const Mac mac = owner_proof(options_.auth_token, nonce_r, nonce_o);
  std::memcpy(c.mac, mac.data(), kMacBytes);
  reply(to, kAmChallenge, &c, sizeof c, nullptr, 0);
}

void UcxOwner::on_auth(const Served& to, const AuthHdr& h) {
  if (to->conn || !to->open || !to->challenge) return;
  const auto [nonce_r, nonce_o] = *to->challenge;
  to->challenge.reset();
  if (!proof_matches(reader_proof(options_.auth_token, nonce_r, nonce_o), h.mac)) {
    to->refused = true;  // one try per connection
    refuse_hello(to, h.conn_id,
                 "the reader's proof of the auth_token is wrong (the tokens differ)");
    return;
  }
  serve_hello(to, h.conn_id);
}

void UcxOwner::refuse_hello(const Served& to, std::uint64_t conn_id, const std::string& why) {
  HelloHdr hdr{};
  hdr.conn_id = conn_id;
  hdr.code = static_cast<std::uint32_t>(StatusCode::kPermissionDenied);
  reply(to, kAmHelloReply, &hdr, sizeof hdr, why.data(), why.size());
}

void UcxOwner::serve_hello(const Served& to, std::uint64_t conn_id) {
  // Every connection gets a ticket: with an auth_token its requests must
  // carry it, and a reader's data endpoint is bound for the replies of the
  // connection that holds it (on_bind).
  std::uint64_t ticket = new_ticket();
  while (ticket == 0 || tickets_.count(ticket) != 0) ticket = new_ticket();
  tickets_.emplace(ticket, to);
  to->ticket = ticket;
  // Reply: u32 region length | RmaRegionInfo bytes | worker address. The
  // address lets a reader open a second endpoint on which UCX may pick
  // shared-memory or RDMA transports for gets (client/server endpoints only
  // use transports reachable through the connection manager).
  HelloHdr hdr{};
  hdr.conn_id = conn_id;
  hdr.ticket = ticket;
  const std::vector<std::uint8_t> region = core_.worker().region().encode();
  const std::vector<std::uint8_t>& address = core_.worker().address();
  std::vector<std::uint8_t> bytes(4 + region.size() + address.size());
  const std::uint32_t n = static_cast<std::uint32_t>(region.size());
  std::memcpy(bytes.data(), &n, 4);
  std::memcpy(bytes.data() + 4, region.data(), region.size());
  if (!address.empty()) {
    std::memcpy(bytes.data() + 4 + region.size(), address.data(), address.size());
  }
  reply(to, kAmHelloReply, &hdr, sizeof hdr, bytes.data(), bytes.size());
}

void UcxOwner::send_err(const Served& to, std::uint64_t batch_id, const Status& st) {
  counters_.refused.fetch_add(1, std::memory_order_relaxed);
  const ErrHdr hdr{batch_id, static_cast<std::uint32_t>(st.code()), 0};
  reply(to, kAmReadErr, &hdr, sizeof hdr, st.message().data(), st.message().size());
}

}  // namespace mstar::kv::ucx
