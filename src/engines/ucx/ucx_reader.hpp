// Copyright mstar-kv authors.
//
// UcxReader, the reader's connections to owners (internal to the ucx
// engine): connecting (the handshake's reader half, the data endpoint for
// gets or shared-memory replies), the reader's control messages (done
// notices, readiness requests and their notices), peer failure (an
// owner's failed message, or its silence: pings), and closing. It owns
// the connections (Conn) and the layer watches waiting on a notice; their
// reads are UcxReads'. Threads: connect() from caller
// threads (it posts to the progress thread and waits); made and cleared
// (clear()) by UcxCore while no progress thread runs; next_watch from any
// thread; the rest on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "rma/rma_engine.hpp"
#include "ucx_backend.hpp"
#include "ucx_part.hpp"
#include "ucx_state.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

class UcxReader : private UcxPart {
 public:
  explicit UcxReader(UcxCore& core);

  // Caller threads: a connection whose handshake completed within
  // `timeout`; throws Error(kTimeout), Error(kShutdown), or the refusal
  // (kPermissionDenied, kUnavailable; anything else as kPeerFailure).
  std::shared_ptr<Conn> connect(const rma::RmaRegionInfo& remote,
                                std::chrono::milliseconds timeout);
  // An active message for the reader's connections (kAmChallenge,
  // kAmHelloReply, kAmReadyNotice, kAmPong), in UCX's handler.
  ucs_status_t handle_am(unsigned id, const void* header, std::size_t header_length, void* data,
                         std::size_t length, const ucp_am_recv_param_t* param);
  // Closes both endpoints and fails the connection's reads. Gets still in
  // flight keep the rma endpoint open until they drain, unless `force`
  // (the peer is dead, the engine stops, or a drain took too long): then it
  // is closed at once and its gets are written off (see close_conn).
  void close_conn(std::shared_ptr<Conn> c, const Status& why, bool force = false);
  // A reader's message `id` on connection `conn` failed (at once or in its
  // completion): the owner cannot be reached, so after this round the
  // connection closes by force and its reads fail. UCX reports some
  // failures of a dead owner only to the request that met them, not to the
  // endpoint's error handler: a read whose request was lost that way would
  // wait for its timeout.
  void message_failed(std::uint64_t conn, unsigned id, ucs_status_t st);
  // Every progress round while reads are in flight (UcxOptions::peer_timeout):
  // pings an owner that reads wait on and that has sent nothing for a
  // quarter of the timeout, closes by force the connection of one silent
  // for all of it (its reads fail as a peer failure).
  void check_peers();
  // Done notices (leases), the reader's half.
  void send_done(const std::shared_ptr<Conn>& c, std::uint64_t seq_id, std::uint64_t epoch);
  // Layer readiness (ucx_readiness.cpp): asks the owner for the next
  // notice of watch w, forgets a watch.
  void send_ready_req(const std::shared_ptr<ReadyWatch>& w);
  void forget_watch(std::uint64_t id) { watches_.erase(id); }
  std::atomic<std::uint64_t> next_watch{1};  // watch ids, unique per core
  // Stopping: closes every connection by force.
  void close_all();
  // After the progress thread ended: drops the connections left.
  void clear() noexcept { conns_.clear(); }

 private:
  // The handshake (ucx_wire.hpp), reader half.
  void on_challenge(const ChallengeHdr& h);
  void hello_reply(const HelloHdr& h, const std::vector<std::uint8_t>& bytes);
  struct EpInfo {
    bool nic_rma = false;  // an RMA lane on an RDMA transport
    bool shm_am = false;   // an active-message lane on shared memory
  };
  EpInfo inspect_ep(ucp_ep_h ep);
  void data_ep_ready(std::uint64_t conn_id, ucs_status_t st);
  // The owner bound the data endpoint for replies (kAmBound).
  void on_bound(const BindHdr& h);
  void on_ready_notice(const ReadyHdr& h, std::string message);
  // The bodies of the C callbacks, each called through trampoline<>.
  static void on_data_ep_flushed(void* request, ucs_status_t st, void* user_data);
  static void on_client_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);

  std::unordered_map<std::uint64_t, std::shared_ptr<Conn>> conns_;          // [progress]
  std::unordered_map<std::uint64_t, std::shared_ptr<ReadyWatch>> watches_;  // [progress]
  std::uint64_t next_conn_ = 1;                                             // [progress]
  std::chrono::steady_clock::time_point peers_checked_{};                   // [progress]
};

}  // namespace mstar::kv::ucx
