// Copyright mstar-kv authors.
//
// A bare UCP client speaking the ucx engine's wire format (ucx_wire.hpp) to
// an owner, as an attacker or a broken reader would: one worker, one
// client/server endpoint to the owner's listener, a handler that records
// every active message that arrives. For the tests of what the owner
// accepts (ucx_auth_test, ucx_strided_wire_test).
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engines/ucx/raw_ucp.hpp"
#include "engines/ucx/ucx_wire.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::testing {

struct Received {
  unsigned id;
  std::vector<std::uint8_t> header;
  std::vector<std::uint8_t> data;
};

class RawClient {
 public:
  explicit RawClient(const std::string& host, std::uint16_t port) {
    for (unsigned id = 1; id <= ucx::kAmMaxId; ++id) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      // One handler per id; the id is recovered from a per-id trampoline arg.
      ids_.push_back(std::make_unique<Tag>(Tag{this, id}));
      hp.arg = ids_.back().get();
      hp.cb = [](void* arg, const void* header, std::size_t hlen, void* data, std::size_t len,
                 const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* tag = static_cast<Tag*>(arg);
        Received r;
        r.id = tag->id;
        r.header.assign(static_cast<const std::uint8_t*>(header),
                        static_cast<const std::uint8_t*>(header) + hlen);
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0 && data != nullptr) {
          r.data.assign(static_cast<std::uint8_t*>(data), static_cast<std::uint8_t*>(data) + len);
        } else {
          r.data.resize(len);
        }
        tag->self->got_.push_back(std::move(r));
        return UCS_OK;
      };
      EXPECT_EQ(ucp_worker_set_am_recv_handler(ucp_.worker, &hp), UCS_OK);
    }
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep.sockaddr.addrlen = sizeof sa;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    EXPECT_EQ(ucp_ep_create(ucp_.worker, &ep, &ep_), UCS_OK);
  }
  ~RawClient() {
    if (ep_) ucp_.close_by_force(ep_);
  }

  void send(unsigned id, const void* header, std::size_t hlen, const void* data = nullptr,
            std::size_t len = 0) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucp_.wait(ucp_am_send_nbx(ep_, id, header, hlen, data, len, &rp));
  }
  // Progresses until `id` arrives or `for_how_long` passed; everything that
  // arrived is in got().
  bool wait_for(unsigned id, std::chrono::milliseconds for_how_long) {
    const auto end = std::chrono::steady_clock::now() + for_how_long;
    while (std::chrono::steady_clock::now() < end) {
      ucp_worker_progress(ucp_.worker);
      for (const Received& r : got_) {
        if (r.id == id) return true;
      }
    }
    return false;
  }
  // The handshake with an owner that has no auth_token: kAmHello as
  // `conn_id`; the reply's header (zeroed, and a test failure, when none
  // came within 5 s).
  ucx::HelloHdr hello(std::uint64_t conn_id) {
    ucx::HelloHdr h{};
    h.conn_id = conn_id;
    send(ucx::kAmHello, &h, sizeof h);
    ucx::HelloHdr r{};
    if (!wait_for(ucx::kAmHelloReply, std::chrono::seconds(5))) {
      ADD_FAILURE() << "no hello reply";
      return r;
    }
    std::memcpy(&r, first(ucx::kAmHelloReply).header.data(), sizeof r);
    return r;
  }
  const std::vector<Received>& got() const { return got_; }
  bool got_any(unsigned id) const {
    for (const Received& r : got_) {
      if (r.id == id) return true;
    }
    return false;
  }
  const Received& first(unsigned id) const {
    for (const Received& r : got_) {
      if (r.id == id) return r;
    }
    throw std::runtime_error("no message " + std::to_string(id));
  }

 private:
  struct Tag {
    RawClient* self;
    unsigned id;
  };
  RawUcp ucp_;  // first: released last
  ucp_ep_h ep_ = nullptr;
  std::vector<std::unique_ptr<Tag>> ids_;
  std::vector<Received> got_;
};

// A ucx owner of `cache` on loopback tcp, listening on 127.0.0.1 at a free
// port (*port), or null when the engine is not built or no port was free.
inline std::unique_ptr<KVTransferManager> tcp_ucx_owner(std::shared_ptr<KVCache> cache,
                                                        const EngineOptions& options,
                                                        std::uint16_t* port) {
  const auto built = built_engines();
  if (std::find(built.begin(), built.end(), "ucx") == built.end()) return nullptr;
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", "lo", 1);
  for (int attempt = 0; attempt < 40; ++attempt) {
    *port = static_cast<std::uint16_t>(30000 + (::getpid() * 13 + attempt * 151) % 9000);
    try {
      return std::make_unique<KVTransferManager>(
          TransferEngineInfo{"owner", "127.0.0.1:" + std::to_string(*port), "ucx", options}, cache);
    } catch (const Error&) {
    }
  }
  return nullptr;
}

}  // namespace mstar::kv::testing
