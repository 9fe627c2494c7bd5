// Copyright mstar-kv authors.
//
// The ucx engine's state (internal to the engine): its tuning constants, a
// reader's connections and reads (Conn, Batch), an owner's served reads
// (ServeState, SendQueue), the contexts UCX requests carry (Pending and its
// kinds) and the two halves of a layer watch. UcxCore (ucx_core.hpp) owns
// them; members marked [progress] are used only on its progress thread.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engines/rma/rma_engine.hpp"
#include "mstar/kv/thread_annotations.hpp"
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
  Endpoint ep;                       // [progress] client/server: control, am reads
  // [progress] to the owner's worker address, where UCX may use shared
  // memory or RDMA: gets, or am reads when its am lane is shared memory.
  Endpoint data_ep;
  RemoteKey rkey;                    // [progress] unpacked on data_ep (get)
  bool am_on_data = false;           // am reads go over data_ep, not ep
  bool closing = false;              // [progress]
  bool hello_set = false;            // [progress]
  std::set<std::uint64_t> batches;   // [progress]
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

struct ReqCtx : Pending {  // a get or a rendezvous receive into local pages
  std::vector<StridedSpan> spans;  // a gathered rendezvous: its spans (local side)
  RowSink sink;                    // a gathered rendezvous: where its rows land
  bool gathered = false;
};

// One served read whose pages are checked once every send completed.
struct ServeState {
  ucp_ep_h ep = nullptr;
  std::uint64_t batch_id = 0;
  std::uint64_t epoch = 0;
  std::vector<std::uint32_t> pages;
  std::size_t left = 0;  // sends not completed, plus one while posting
  bool failed = false;
};

// One served read's replies not yet posted: the owner keeps at most
// kSendWindow of them in flight per read and posts the next as each
// completes. UCX over tcp slows down with thousands of outstanding sends:
// 64 KiB x 4096 ran at 1.55 GB/s with every reply posted at once, 2.7-2.8
// with 16-64 in flight, 2.1 with 256 (bench/README.md, "UCX send window").
struct SendQueue {
  ucp_ep_h ep = nullptr;
  std::uint64_t batch_id = 0;
  std::uint64_t flags = 0;
  std::vector<CopySpan> spans;  // rows checked against the region
  // kReqStrided: the strided spans instead (checked, never expanded).
  std::vector<StridedSpan> strided;
  // kReqGather: groups of spans (or strided spans) [first, first + count),
  // one message each.
  std::vector<std::pair<std::size_t, std::size_t>> groups;
  std::shared_ptr<ServeState> serve;  // null when no epoch is checked
  std::size_t next = 0;       // the next span (or group) to post
  std::size_t in_flight = 0;  // posted, not completed
  bool done_posting = false;
  std::size_t total() const noexcept { return groups.empty() ? spans.size() : groups.size(); }
};
inline constexpr std::size_t kSendWindow = 32;

struct SendCtx : Pending {  // a data reply (its header must outlive the send)
  DataHdr hdr{};
  std::shared_ptr<SendQueue> queue;   // the read it belongs to
  std::shared_ptr<ServeState> serve;  // null when no epoch is checked
  GatherHdr gather{};                 // gathered replies (kReqGather)
  std::vector<ucp_dt_iov_t> iov;      // their spans in the registered pages
  RowSource rows;                     // or, kReqStrided, their strided spans' rows
};

// A control message's bytes (header then data), or the wireup flush of
// connection conn_id's data endpoint.
struct Control : Pending {
  std::vector<std::uint8_t> bytes;
  std::uint64_t conn_id = 0;
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
  std::uint32_t layers MSTAR_KV_GUARDED_BY(mu) = 0;      // the last notice's count
  bool outstanding MSTAR_KV_GUARDED_BY(mu) = false;      // a request awaits its notice
  std::optional<Status> error MSTAR_KV_GUARDED_BY(mu);   // the watch failed
};

// The owner's half: a request held until its count moves (ucx_readiness.cpp).
struct ReadyHold {
  ucp_ep_h ep = nullptr;
  ReadyReqHdr hdr{};
  std::vector<std::uint32_t> pages;
  std::chrono::steady_clock::time_point until;
};

}  // namespace mstar::kv::ucx
