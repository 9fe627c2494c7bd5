// Copyright mstar-kv authors.
//
// The ucx engine's state (internal to the engine): its tuning constants, a
// reader's connections and reads (Conn, Batch), an owner's endpoints and
// served reads (ServedEp, SendQueue), the contexts UCX requests carry (Pending and its
// kinds) and the two halves of a layer watch. The parts of UcxCore
// (ucx_core.hpp) own them; members marked [progress] are used only on its
// progress thread.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/staging.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "rma/rma_engine.hpp"
#include "ucx_auth.hpp"
#include "ucx_backend.hpp"
#include "ucx_handles.hpp"
#include "ucx_rows.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

constexpr std::uint64_t kMaxSpansPerRequest = 1u << 22;
// A read gathers (kReqGather) when it has at least this many spans of on
// average fewer bytes than this: the owner then sends groups of spans as
// messages of up to 1 MiB (kGatherBytes). Over tcp with 64 KiB segments a
// group beat one message per span at every size up to 128 KiB (64 KiB x 128:
// 3.2 -> 4.0-4.6 GB/s, 4 KiB x 4096: 1.8 -> 3.8).
constexpr std::size_t kGatherMinSpans = 64;
constexpr std::uint64_t kGatherBelowBytes = 256u << 10;

// Whether a read of these spans gets gathered replies (kReqGather): many,
// and small on average.
inline bool gathers(const std::vector<CopySpan>& spans) {
  if (spans.size() < kGatherMinSpans) return false;
  std::uint64_t total = 0;
  for (const CopySpan& s : spans) total += s.length;
  return total / spans.size() < kGatherBelowBytes;
}
// Gets in flight per read. Small enough that an aborted read drains in
// microseconds on shared memory, large enough to keep a NIC busy.
constexpr std::size_t kGetWindow = 16;
// How long an aborted read's gets may take to drain before the connection
// is closed by force.
constexpr std::chrono::milliseconds kDrainGrace{250};

inline std::string ucs_str(ucs_status_t st) { return ucs_status_string(st); }

class UcxCore;

struct Conn {
  UcxCore* core = nullptr;
  std::uint64_t id = 0;
  std::string session_id;
  Endpoint ep;  // [progress] client/server: control, am reads
  // [progress] to the owner's worker address, where UCX may use shared
  // memory or RDMA: gets, or am reads when its am lane is shared memory.
  Endpoint data_ep;
  // [progress] unpacked on data_ep (get): one per region of the owner, and
  // where its layout offsets are in the owner.
  std::vector<RemoteKey> rkeys;
  RegionMap remote;
  bool am_on_data = false;          // am replies come over data_ep (kReqReplyOnData)
  bool bind_sent = false;           // [progress] kAmBind sent on data_ep
  bool bound = false;               // [progress] the owner answered it (kAmBound)
  bool closing = false;             // [progress]
  bool hello_set = false;           // [progress]
  std::set<std::uint64_t> batches;  // [progress]
  // [progress] The owner's liveness while reads wait (check_peers): when
  // it last sent anything for this connection (or a read started after a
  // quiet spell), and when it was last pinged.
  std::chrono::steady_clock::time_point heard{};
  std::chrono::steady_clock::time_point pinged{};
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
  // kReqGather: the owner sends groups of units (chunks, or with
  // kReqStrided whole strided spans); got[i] marks unit i landed (each
  // exactly once), got_count how many did.
  bool gather = false;
  std::vector<std::uint8_t> got;
  std::size_t got_count = 0;
  // kReqStrided: the spans as planned, never expanded into rows (chunks is
  // empty; over gets they become rows in start_batch).
  std::vector<StridedSpan> strided;
  std::size_t units() const noexcept { return strided.empty() ? chunks.size() : strided.size(); }
  // A large gathered read: its rows are written with non-temporal stores.
  bool stream = false;
  // ucx_staging: every reply is a gathered message (gather_groups) received
  // into a host buffer of this pipeline and scattered from there into the
  // cache; `waiting` holds messages that found every buffer busy (a
  // rendezvous' descriptor, kept by UCX until received or released, or an
  // eager message's bytes).
  struct Waiting {
    std::size_t message = 0;
    void* rndv = nullptr;
    std::vector<std::byte> eager;
  };
  std::unique_ptr<staging::ScatterPipeline> staged;
  std::vector<std::size_t> message_of;  // unit index of a message's first -> message + 1
  std::deque<Waiting> waiting;
};

// The user_data of a UCX request, owned by an InFlight<> of the core from
// posting until the request's callback (ucx_callback.hpp).
struct Pending {
  UcxCore* core = nullptr;
  std::uint64_t batch_id = 0;  // the read of this core it writes for, or 0
};

// What a request's user_data (posted as a Pending*) points at.
template <class T>
T* context_of(void* user_data) noexcept {
  return static_cast<T*>(static_cast<Pending*>(user_data));
}

struct ReqCtx : Pending {          // a get or a rendezvous receive into local pages
  ucp_mem_h memh = nullptr;        // a contiguous receive: the region it lands in
  std::vector<StridedSpan> spans;  // a gathered rendezvous: its spans (local side)
  RowSink sink;                    // a gathered rendezvous: where its rows land
  bool gathered = false;
  // A rendezvous into a staging buffer (ucx_staging): the read's message.
  std::optional<std::size_t> staged;
};

// An endpoint the owner answers on, as every reply holds it: the listener
// endpoint of one reader's connection, or (ucx_mode=am_shm) an endpoint UCX
// made for that reader's data endpoint, which answers for the connection
// whose ticket its requests carry. Never a bare ucp_ep_h held across
// progress rounds: UCX destroys a force-closed endpoint inside the close
// and may still complete sends of it as successful afterwards, and the next
// endpoint it makes reuses the address, so a reply held by address went to
// a freed endpoint (the owner died in ucp_am_send_nbx) or to the next
// reader. A closed record sends nothing: each reply for it is dropped and
// counted (UcxCore::drop).
struct ServedEp {
  ucp_ep_h ep = nullptr;
  // A data endpoint: the connection it answers for; null for a listener
  // endpoint (which owns the rest).
  std::shared_ptr<ServedEp> conn;
  bool open = true;  // [progress] false from the connection's close on
  // [progress] The handshake (ucx_auth.hpp), listener endpoints only: the
  // nonces of the challenge sent, a refused proof (one try), and the ticket
  // issued (every connection gets one; with an auth_token requests must
  // carry it).
  std::optional<std::pair<Nonce, Nonce>> challenge;
  bool refused = false;
  std::uint64_t ticket = 0;
  // [progress] Listener endpoints: the reader's data endpoint bound for
  // replies (kAmBind), an endpoint UCX made and owns; null until bound.
  ucp_ep_h data_reply = nullptr;
  bool usable() const noexcept { return open && (!conn || conn->open); }
};
using Served = std::shared_ptr<ServedEp>;

// One served read: its replies not yet posted and, with an epoch, the
// pages whose epochs are checked once every send completed (the verdict).
// The owner keeps at most kSendWindow replies in flight per read and posts
// the next as each completes. UCX over tcp slows down with thousands of
// outstanding sends: 64 KiB x 4096 ran at 1.55 GB/s with every reply posted
// at once, 2.7-2.8 with 16-64 in flight, 2.1 with 256 (bench/README.md,
// "UCX send window").
struct SendQueue {
  Served ep;
  std::uint64_t batch_id = 0;
  std::uint64_t flags = 0;
  std::vector<CopySpan> spans;  // rows checked against the region
  // kReqStrided: the strided spans instead (checked, never expanded).
  std::vector<StridedSpan> strided;
  // kReqGather: groups of spans (or strided spans) [first, first + count),
  // one message each.
  std::vector<std::pair<std::size_t, std::size_t>> groups;
  std::uint64_t epoch = 0;  // 0: no verdict
  std::vector<std::uint32_t> pages;
  std::size_t next = 0;       // the next span (or group) to post
  std::size_t in_flight = 0;  // posted, not completed
  std::size_t left = 0;       // sends not completed, plus one while posting
  bool done_posting = false;
  bool failed = false;  // a send failed: no verdict (the reader fails by itself)
  // ucx_staging: each message (a group, or without kReqGather a span) is
  // gathered from the cache into a host buffer of this pipeline and sent
  // from there; `strided` then holds the spans (of one row each without
  // kReqStrided).
  std::unique_ptr<staging::GatherPipeline> staged;
  bool staged_data = false;  // its messages are single spans (kAmReadData)
  std::size_t total() const noexcept { return groups.empty() ? spans.size() : groups.size(); }
};
inline constexpr std::size_t kSendWindow = 32;

struct SendCtx : Pending {  // a data reply (its header must outlive the send)
  DataHdr hdr{};
  std::shared_ptr<SendQueue> queue;   // the read it belongs to
  std::uint64_t bytes = 0;            // its payload
  GatherHdr gather{};                 // gathered replies (kReqGather)
  std::vector<ucp_dt_iov_t> iov;      // their spans in the registered pages
  RowSource rows;                     // or, kReqStrided, their strided spans' rows
  std::optional<std::size_t> staged;  // ucx_staging: the message whose buffer it sends
};

// A control message's bytes (header then data), or the wireup flush of
// connection conn_id's data endpoint.
struct Control : Pending {
  std::vector<std::uint8_t> bytes;
  std::uint64_t conn_id = 0;  // a reader's message: its connection, else 0
  unsigned id = 0;            // the message's active-message id (kAm*)
};

// The reader's half of one layer watch (ucx_readiness.cpp), shared by the
// watch (stream driver's thread) and the progress thread.
struct ReadyWatch {
  std::uint64_t id = 0;
  std::shared_ptr<Conn> conn;
  std::vector<std::uint32_t> pages;
  std::uint64_t epoch = 0;
  std::uint32_t num_layers = 0;
  std::mutex mu;
  std::uint32_t layers MSTAR_KV_GUARDED_BY(mu) = 0;     // the last notice's count
  bool outstanding MSTAR_KV_GUARDED_BY(mu) = false;     // a request awaits its notice
  std::optional<Status> error MSTAR_KV_GUARDED_BY(mu);  // the watch failed
};

// The owner's half: a request held until its count moves (ucx_readiness.cpp).
struct ReadyHold {
  Served ep;
  ReadyReqHdr hdr{};
  std::vector<std::uint32_t> pages;
  std::chrono::steady_clock::time_point until;
};

}  // namespace mstar::kv::ucx
