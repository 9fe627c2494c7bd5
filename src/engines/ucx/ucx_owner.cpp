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
  Endpoint owned(h);  // closed again if it cannot be kept
  self->server_eps_.emplace(h, std::move(owned));
}

void UcxCore::on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* self = static_cast<UcxCore*>(arg);
  self->deferred_.push_back([self, ep] { self->close_server_ep(ep); });
}

void UcxCore::close_server_ep(ucp_ep_h ep) {
  auto owned = server_eps_.find(ep);
  if (owned == server_eps_.end()) return;
  Endpoint closing = std::move(owned->second);
  server_eps_.erase(owned);
  challenged_.erase(ep);
  refused_.erase(ep);
  if (auto t = ep_ticket_.find(ep); t != ep_ticket_.end()) {
    tickets_.erase(t->second);  // the reader's requests are refused from now on
    ep_ticket_.erase(t);
  }
  dead_eps_.insert(ep);
  close_ep(std::move(closing), RemoteKey(), nullptr);
}

void UcxCore::send_small(ucp_ep_h ep, unsigned id, const void* header,
                         std::size_t header_len, const void* data, std::size_t data_len,
                         bool reply) {
  auto msg = std::make_unique<Control>();
  msg->core = this;
  msg->bytes.resize(header_len + data_len);
  if (header_len) std::memcpy(msg->bytes.data(), header, header_len);
  if (data_len) std::memcpy(msg->bytes.data() + header_len, data, data_len);
  Control* block = controls_.add(std::move(msg));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                    UCP_OP_ATTR_FIELD_USER_DATA;
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

}  // namespace mstar::kv::ucx
