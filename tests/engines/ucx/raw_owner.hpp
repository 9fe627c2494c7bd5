// Copyright mstar-kv authors.
//
// A bare UCP owner speaking the ucx engine's wire format (ucx_wire.hpp) to a
// reader, as a lying or broken owner would: a listener on 127.0.0.1, the
// handshake answered with the region it was given (no worker address, so the
// reader reads by active messages on the one endpoint), and every read
// request handed to the test's `on_read`, which answers it as it likes
// (send()). Its own progress thread; replies go out from it. For the tests
// of what a reader accepts (ucx_forged_owner_test).
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engines/ucx/raw_ucp.hpp"
#include "engines/ucx/ucx_wire.hpp"
#include "mstar/kv/kv.hpp"
#include "rma/rma_backend.hpp"

namespace mstar::kv::testing {

class RawOwner {
 public:
  // A read request as it arrived: its header and its body (spans, then pages).
  struct Request {
    ucx::ReadReqHdr hdr{};
    std::vector<std::uint8_t> body;
  };
  using OnRead = std::function<void(RawOwner&, ucp_ep_h, const Request&)>;

  // Serves `region` (its session_id is set to the listener's address).
  RawOwner(rma::RmaRegionInfo region, OnRead on_read)
      : region_(std::move(region)), on_read_(std::move(on_read)) {
    for (unsigned id : {ucx::kAmHello, ucx::kAmReadReq, ucx::kAmDone}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.arg = this;
      hp.cb = id == ucx::kAmHello     ? &RawOwner::on_hello
              : id == ucx::kAmReadReq ? &RawOwner::on_read_req
                                      : &RawOwner::on_ignored;
      EXPECT_EQ(ucp_worker_set_am_recv_handler(ucp_.worker, &hp), UCS_OK);
    }
    for (int attempt = 0; attempt < 40 && listener_ == nullptr; ++attempt) {
      port_ = static_cast<std::uint16_t>(40000 + (::getpid() * 17 + attempt * 173) % 9000);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(port_);
      inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
      lp.sockaddr.addrlen = sizeof sa;
      lp.conn_handler.cb = &RawOwner::on_conn;
      lp.conn_handler.arg = this;
      if (ucp_listener_create(ucp_.worker, &lp, &listener_) != UCS_OK) listener_ = nullptr;
    }
    EXPECT_NE(listener_, nullptr) << "no free port";
    region_.session_id = "127.0.0.1:" + std::to_string(port_);
    thread_ = std::thread([this] { run(); });
  }
  ~RawOwner() {
    stop_ = true;
    thread_.join();
    for (ucp_ep_h ep : eps_) ucp_.close_by_force(ep);
    if (listener_) ucp_listener_destroy(listener_);
  }
  RawOwner(const RawOwner&) = delete;
  RawOwner& operator=(const RawOwner&) = delete;

  // The descriptor a reader is given for this owner.
  KVTransferInfo descriptor() const { return KVTransferInfo{"ucx", region_.encode()}; }
  const rma::RmaRegionInfo& region() const { return region_; }

  // One eager active message, waited for (call from on_read only: the
  // progress thread).
  void send(ucp_ep_h ep, unsigned id, const void* header, std::size_t hlen, const void* data,
            std::size_t len) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    ucp_.wait(ucp_am_send_nbx(ep, id, header, hlen, data, len, &rp));
  }

 private:
  static void on_conn(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<RawOwner*>(arg);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.conn_request = req;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};  // the reader went: fine
    ucp_ep_h h = nullptr;
    if (ucp_ep_create(self->ucp_.worker, &ep, &h) == UCS_OK) self->eps_.push_back(h);
  }
  static ucs_status_t on_hello(void* arg, const void* header, std::size_t hlen, void*, std::size_t,
                               const ucp_am_recv_param_t* param) {
    auto* self = static_cast<RawOwner*>(arg);
    if (hlen != sizeof(ucx::HelloHdr) ||
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
      return UCS_OK;
    }
    ucx::HelloHdr h;
    std::memcpy(&h, header, sizeof h);
    ucp_ep_h ep = param->reply_ep;
    self->tasks_.push_back([self, ep, h] {
      ucx::HelloHdr reply{};
      reply.conn_id = h.conn_id;
      const std::vector<std::uint8_t> region = self->region_.encode();
      std::vector<std::uint8_t> bytes(4 + region.size());
      const auto n = static_cast<std::uint32_t>(region.size());
      std::memcpy(bytes.data(), &n, 4);
      std::memcpy(bytes.data() + 4, region.data(), region.size());
      self->send(ep, ucx::kAmHelloReply, &reply, sizeof reply, bytes.data(), bytes.size());
    });
    return UCS_OK;
  }
  static ucs_status_t on_read_req(void* arg, const void* header, std::size_t hlen, void* data,
                                  std::size_t len, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<RawOwner*>(arg);
    if (hlen != sizeof(ucx::ReadReqHdr) ||
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0 ||
        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      ADD_FAILURE() << "a read request the raw owner cannot take";
      return UCS_OK;
    }
    Request r;
    std::memcpy(&r.hdr, header, sizeof r.hdr);
    r.body.assign(static_cast<std::uint8_t*>(data), static_cast<std::uint8_t*>(data) + len);
    ucp_ep_h ep = param->reply_ep;
    self->tasks_.push_back([self, ep, r] { self->on_read_(*self, ep, r); });
    return UCS_OK;
  }
  static ucs_status_t on_ignored(void*, const void*, std::size_t, void*, std::size_t,
                                 const ucp_am_recv_param_t*) {
    return UCS_OK;
  }
  void run() {
    while (!stop_) {
      ucp_worker_progress(ucp_.worker);
      while (!tasks_.empty()) {
        auto t = std::move(tasks_.front());
        tasks_.pop_front();
        t();
      }
    }
  }

  RawUcp ucp_;  // first: released last
  rma::RmaRegionInfo region_;
  OnRead on_read_;
  ucp_listener_h listener_ = nullptr;
  std::uint16_t port_ = 0;
  std::vector<ucp_ep_h> eps_;                // [progress thread]
  std::deque<std::function<void()>> tasks_;  // [progress thread]
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace mstar::kv::testing
