// Copyright mstar-kv authors.
//
// UcxOwner, the owner's side of the ucx engine (internal to the engine):
// the listener, the readers' connections to it (their endpoints, as
// ServedEp records, and tickets), the handshake's owner half, the owner's
// active messages (read requests go on to UcxServedReads), readers' done
// notices, readiness requests held until their count moves, and the
// counters of what it served. Threads: made and cleared (clear()) by UcxCore
// while no progress thread runs; served_stats() and set_done_handler() from
// any thread; the rest on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "mstar/kv/util/thread_annotations.hpp"
#include "ucx_backend.hpp"
#include "ucx_handles.hpp"
#include "ucx_part.hpp"
#include "ucx_state.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

class UcxOwner : private UcxPart {
 public:
  // What this owner served (ServedStats), counted where it happens.
  struct Counters {
    std::atomic<std::uint64_t> reads{0}, bytes{0}, refused{0}, dropped{0}, connected{0}, gone{0},
        staged{0};
  };

  // Opens the listener on `session_id` ("HOST:PORT"; empty or a bare label:
  // 127.0.0.1 at a free port in 20000-29999) and sets the worker region's
  // session id. Throws Error(kRetryLater) when the port is taken,
  // Error(kUnavailable) when no listener opens.
  UcxOwner(UcxCore& core, const std::string& session_id);

  // An active message for the owner (kAmHello, kAmAuth, kAmReadReq,
  // kAmDone, kAmReadyReq, kAmPing: answered with kAmPong, kAmBind), in
  // UCX's handler.
  ucs_status_t handle_am(unsigned id, const void* header, std::size_t header_length, void* data,
                         std::size_t length, const ucp_am_recv_param_t* param);
  // Sends a small reply on `to`, or, its endpoint gone, drops it (drop()).
  void reply(const Served& to, unsigned id, const void* header, std::size_t header_len,
             const void* data, std::size_t data_len);
  // `n` replies (or verdicts) for a reader whose endpoint is gone were not
  // sent: counted, and logged the first time.
  void drop(std::uint64_t n, const char* what);
  // Refuses read batch_id (counted as refused).
  void send_err(const Served& to, std::uint64_t batch_id, const Status& st);
  // True when a request carrying `ticket` may be served (always without a
  // token on this owner).
  bool ticket_valid(std::uint64_t ticket) const {
    return options_.auth_token.empty() || (ticket != 0 && tickets_.count(ticket) != 0);
  }
  Counters& counters() noexcept { return counters_; }
  // Any thread.
  ServedStats served_stats() const noexcept;
  void set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> h) {
    std::lock_guard<std::mutex> lk(done_mu_);
    done_handler_ = std::move(h);
  }
  // Layer readiness: re-checks the held requests (every progress round
  // while any is held).
  bool holding() const noexcept { return !ready_holds_.empty(); }
  void check_ready_holds();
  // Stopping: closes every reader's endpoint and the listener.
  void close_all();
  // After the progress thread ended: drops the endpoints left.
  void clear() noexcept;

 private:
  void open_listener(const std::string& session_id);
  // The bodies of the C callbacks, each called through trampoline<>.
  static void on_conn_request(ucp_conn_request_h req, void* arg);
  static void on_server_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  void close_server_ep(ucp_ep_h ep);
  // The record of the connection whose listener endpoint is `reply_ep`;
  // null for any other endpoint. In the active-message handler, while
  // reply_ep is valid.
  Served served_of(ucp_ep_h reply_ep);
  // The handshake (ucx_wire.hpp), owner half.
  void on_hello(const Served& to, const HelloHdr& h);
  void on_auth(const Served& to, const AuthHdr& h);
  // A reader's data endpoint, bound for the replies of its connection
  // (kAmBind), answered with kAmBound. In the active-message handler.
  void on_bind(ucp_ep_h reply_ep, const BindHdr& h);
  void serve_hello(const Served& to, std::uint64_t conn_id);
  void refuse_hello(const Served& to, std::uint64_t conn_id, const std::string& why);
  // Layer readiness (ucx_readiness.cpp): answers or holds a request.
  void on_ready_req(const Served& to, const ReadyReqHdr& h, std::vector<std::uint32_t> pages);
  bool answer_ready(const ReadyHold& r, bool expired);

  Listener listener_;
  // [progress] The owner's listener endpoints (one per reader connection),
  // each with the record its replies hold (ServedEp), and the connections
  // by ticket.
  struct Listened {
    Endpoint owned;
    Served served;
  };
  std::unordered_map<ucp_ep_h, Listened> server_eps_;
  std::unordered_map<std::uint64_t, Served> tickets_;
  std::vector<ReadyHold> ready_holds_;  // [progress]
  std::mutex done_mu_;
  std::function<void(std::uint64_t, std::uint64_t)> done_handler_ MSTAR_KV_GUARDED_BY(done_mu_);
  Counters counters_;
  std::atomic<bool> drop_logged_{false};
};

}  // namespace mstar::kv::ucx
