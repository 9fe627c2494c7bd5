// Copyright mstar-kv authors.
//
// UcxCore, the owner's side: listener connections and the handshake
// (served reads: ucx_serve.cpp).
#include "ucx_core.hpp"

namespace mstar::kv::ucx {

// ---- server side -----------------------------------------------------------

void UcxCore::on_conn_request(ucp_conn_request_h req, void* arg) {
  auto* self = static_cast<UcxCore*>(arg);
  if (self->stop_requested_.load(std::memory_order_acquire)) {
    ucp_listener_reject(self->listener_.get(), req);
    return;
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = trampoline<&UcxCore::on_server_ep_error, CoreGuard>;
  ep.err_handler.arg = self;
  ucp_ep_h h = nullptr;
  if (ucp_ep_create(self->worker_.get(), &ep, &h) != UCS_OK) return;
  Listened l{Endpoint(h), std::make_shared<ServedEp>()};  // closed again if it cannot be kept
  l.served->ep = h;
  self->server_eps_.emplace(h, std::move(l));
  self->counters_.connected.fetch_add(1, std::memory_order_relaxed);
}

void UcxCore::on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* self = static_cast<UcxCore*>(arg);
  self->deferred_.push_back([self, ep] { self->close_server_ep(ep); });
}

void UcxCore::close_server_ep(ucp_ep_h ep) {
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
  close_ep(std::move(closing), {}, nullptr);
}

Served UcxCore::served_of(ucp_ep_h reply_ep, std::uint64_t ticket) {
  if (auto it = server_eps_.find(reply_ep); it != server_eps_.end()) return it->second.served;
  // A reader's data endpoint (ucx_mode=am_shm): UCX made this endpoint and
  // owns it; it answers for the connection whose ticket the request
  // carries, and is dropped with it. (UCX destroys such an endpoint by
  // itself only when one of its lanes fails; shared-memory lanes, which
  // am_shm requires for active messages, detect no failure.)
  const auto c = tickets_.find(ticket);
  if (ticket == 0 || c == tickets_.end()) return nullptr;
  auto s = std::make_shared<ServedEp>();
  s->ep = reply_ep;
  s->conn = c->second;
  return s;
}

void UcxCore::reply(const Served& to, unsigned id, const void* header, std::size_t header_len,
                    const void* data, std::size_t data_len) {
  if (!to->usable()) {
    drop(1, id == kAmReadFin ? "an epoch verdict" : "a reply");
    return;
  }
  send_small(to->ep, id, header, header_len, data, data_len, false);
}

void UcxCore::drop(std::uint64_t n, const char* what) {
  // Shutting down closes every connection: what it leaves unsent is no
  // reader's going away.
  if (stop_requested_.load(std::memory_order_acquire)) return;
  counters_.dropped.fetch_add(n, std::memory_order_relaxed);
  if (!drop_logged_.exchange(true, std::memory_order_relaxed)) {
    options_.log.warn(std::string("ucx owner: ") + what +
                      " for a reader whose connection closed was dropped (the reader went away "
                      "with reads in flight); later ones are counted, not logged "
                      "(stats: served replies_dropped)");
  }
}

ServedStats UcxCore::served_stats() const noexcept {
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

void UcxCore::send_small(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_len,
                         const void* data, std::size_t data_len, bool reply) {
  auto msg = std::make_unique<Control>();
  msg->core = this;
  msg->bytes.resize(header_len + data_len);
  if (header_len) std::memcpy(msg->bytes.data(), header, header_len);
  if (data_len) std::memcpy(msg->bytes.data() + header_len, data, data_len);
  Control* block = controls_.add(std::move(msg));
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  rp.cb.send = trampoline<&UcxCore::on_control_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(block);
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, id, block->bytes.data(), header_len,
                                        block->bytes.data() + header_len, data_len, &rp);
  if (!UCS_PTR_IS_PTR(sp)) controls_.take(block);  // done (or failed) at once
}

void UcxCore::on_control_sent(void* req, ucs_status_t, void* ud) {
  const Request freed(req);
  auto* c = context_of<Control>(ud);
  c->core->controls_.take(c);
}

void UcxCore::on_hello(const Served& to, const HelloHdr& h) {
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

void UcxCore::on_auth(const Served& to, const AuthHdr& h) {
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

void UcxCore::refuse_hello(const Served& to, std::uint64_t conn_id, const std::string& why) {
  HelloHdr hdr{};
  hdr.conn_id = conn_id;
  hdr.code = static_cast<std::uint32_t>(StatusCode::kPermissionDenied);
  reply(to, kAmHelloReply, &hdr, sizeof hdr, why.data(), why.size());
}

void UcxCore::serve_hello(const Served& to, std::uint64_t conn_id) {
  // Every connection gets a ticket: with an auth_token its requests must
  // carry it, and a request on a reader's data endpoint is answered for
  // the connection that holds it (served_of).
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
  const std::vector<std::uint8_t> region = region_.encode();
  std::vector<std::uint8_t> bytes(4 + region.size() + worker_address_.size());
  const std::uint32_t n = static_cast<std::uint32_t>(region.size());
  std::memcpy(bytes.data(), &n, 4);
  std::memcpy(bytes.data() + 4, region.data(), region.size());
  if (!worker_address_.empty()) {
    std::memcpy(bytes.data() + 4 + region.size(), worker_address_.data(), worker_address_.size());
  }
  reply(to, kAmHelloReply, &hdr, sizeof hdr, bytes.data(), bytes.size());
}

void UcxCore::send_err(const Served& to, std::uint64_t batch_id, const Status& st) {
  counters_.refused.fetch_add(1, std::memory_order_relaxed);
  const ErrHdr hdr{batch_id, static_cast<std::uint32_t>(st.code()), 0};
  reply(to, kAmReadErr, &hdr, sizeof hdr, st.message().data(), st.message().size());
}

}  // namespace mstar::kv::ucx
