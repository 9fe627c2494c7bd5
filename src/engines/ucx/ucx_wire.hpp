// Copyright mstar-kv authors.
//
// The ucx engine's wire format: active-message ids and their headers.
// Both ends run this code on the same architecture; every header and span
// list is still length-checked, and the owner validates every requested
// range against its region.
//
// Connecting (reader -> owner, on the client/server endpoint):
//   kAmHello      {conn_id, flags, nonce_r}
//   without an auth_token on the owner:
//     kAmHelloReply {conn_id, ticket 0, code 0} + region | worker address
//   with one (ucx_auth.hpp), the owner proves the secret first, then the reader:
//     kAmChallenge  {conn_id, nonce_o, HMAC(k, owner label | nonce_r | nonce_o)}
//     kAmAuth       {conn_id, HMAC(k, reader label | nonce_o | nonce_r)}
//     kAmHelloReply {conn_id, ticket, code 0} + region | worker address
//                   or {conn_id, 0, kPermissionDenied} + message
// The region (address, remote key, worker address) is only sent after the
// reader proved the secret. Every later request (ReadReq, Done) carries the
// ticket, which the owner checks; a reader's data endpoint reaches the owner
// on an endpoint UCX made, not the one that authenticated, and its one
// message (kAmBind) names the connection by the ticket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace mstar::kv::ucx {

enum AmId : unsigned {
  kAmHello = 1,         // reader -> owner: which region do you serve?
  kAmHelloReply = 2,    // owner -> reader: RmaRegionInfo bytes, or why not
  kAmReadReq = 3,       // reader -> owner: spans to send back
  kAmReadData = 4,      // owner -> reader: one span's bytes
  kAmReadErr = 5,       // owner -> reader: request rejected
  kAmReadFin = 6,       // owner -> reader: page epochs still held after the sends
  kAmDone = 7,          // reader -> owner: done with a sequence (DoneHdr)
  kAmChallenge = 8,     // owner -> reader: prove the shared secret (ChallengeHdr)
  kAmAuth = 9,          // reader -> owner: the proof (AuthHdr)
  kAmGatherData = 10,   // owner -> reader: many spans' bytes in one message (GatherHdr)
  kAmReadyReq = 11,     // reader -> owner: tell me when more layers are ready (ReadyReqHdr)
  kAmReadyNotice = 12,  // owner -> reader: layers ready, or why not (ReadyHdr)
  kAmPing = 13,         // reader -> owner: are you there? (PingHdr)
  kAmPong = 14,         // owner -> reader: yes (the PingHdr echoed)
  kAmBind = 15,         // reader -> owner, on the data endpoint: reply here (BindHdr)
  kAmBound = 16,        // owner -> reader, on that endpoint: bound (the BindHdr echoed)
  kAmMaxId = 16,
};

inline constexpr std::size_t kNonceBytes = 16;
inline constexpr std::size_t kMacBytes = 32;

// Hello flags.
inline constexpr std::uint32_t kHelloHasToken = 1;  // the reader holds an auth_token

struct HelloHdr {
  std::uint64_t conn_id;            // the reader's connection, echoed in every reply
  std::uint64_t ticket;             // reply: the connection's ticket (0 without auth)
  std::uint32_t code;               // reply: 0, or the StatusCode refusing the reader
  std::uint32_t flags;              // hello: kHelloHasToken
  std::uint8_t nonce[kNonceBytes];  // hello: the reader's nonce
};
struct ChallengeHdr {
  std::uint64_t conn_id;
  std::uint8_t nonce[kNonceBytes];  // the owner's nonce
  std::uint8_t mac[kMacBytes];      // the owner's proof
};
struct AuthHdr {
  std::uint64_t conn_id;
  std::uint8_t mac[kMacBytes];  // the reader's proof
};

// A reader waiting on an owner that has sent nothing for a while asks
// whether it is still there (UcxOptions::peer_timeout).
struct PingHdr {
  std::uint64_t conn_id;  // the reader's connection, echoed
  std::uint64_t ticket;
};

// A reader whose data endpoint carries active messages over shared memory
// (ucx_mode=am_shm) sends its requests on the control endpoint like any
// other and binds the data endpoint once, for the owner's replies
// (kReqReplyOnData). Only this small message ever crosses the owner's
// shared-memory receive fifo: a reader killed while it wrote a request of
// thousands of spans into that fifo left it stuck for every later reader
// (UCX 1.13 has no peer error handling on shared-memory endpoints; 2 of 80
// owner-survival runs beside a loaded machine).
struct BindHdr {
  std::uint64_t conn_id;  // the reader's connection, echoed in kAmBound
  std::uint64_t ticket;   // HelloHdr.ticket: the connection bound
};

struct DoneHdr {
  std::uint64_t seq_id;
  std::uint64_t epoch;
  std::uint64_t generation;
  std::uint64_t ticket;
};

struct ReadReqHdr {
  std::uint64_t batch_id;
  std::uint64_t generation;
  std::uint64_t nspans;
  std::uint64_t flags;  // kReqEagerOnly, kReqCheckOnly
  // Page epochs (epochs.hpp): with epoch != 0, the npages u32 page indices
  // after the spans must carry it before the owner sends and still once its
  // sends completed (then it answers kAmReadFin).
  std::uint64_t epoch;
  std::uint64_t npages;
  std::uint64_t ticket;  // HelloHdr.ticket of the reader's connection
};
// No spans: only check the pages' epochs and answer kAmReadFin (the
// before/after checks around one-sided gets).
inline constexpr std::uint64_t kReqCheckOnly = 2;
// Reply with eager messages only. Set by readers on a shared-memory data
// endpoint: there a rendezvous runs over cma without peer error handling,
// and UCX 1.13 aborts the reading process when the owner dies mid-transfer
// (measured); eager data only ever sits in the reader's own fifo.
inline constexpr std::uint64_t kReqEagerOnly = 1;
// Reply on the data endpoint this connection bound (kAmBind), not on the
// endpoint the request came on; refused when none is bound.
inline constexpr std::uint64_t kReqReplyOnData = 16;
// Many spans (a change of in-page order or head shard makes rows of a few
// hundred bytes; a scattered page table blocks of 4-128 KiB): the owner
// gathers consecutive spans from its registered pages into one message (an
// iov datatype, no copy on its side) of at most kGatherBytes, and the reader
// scatters it into its pages, instead of one message per span.
inline constexpr std::uint64_t kReqGather = 4;
inline constexpr std::uint64_t kGatherBytes = 1024u << 10;
// With kReqGather: the spans are WireStrided, "rows of length bytes, strides
// apart on each side" (planner.hpp's StridedSpan), not WireSpan, and
// GatherHdr counts whole strided spans: the owner gathers a message's rows
// from its pages span by span, the reader scatters them into its rows, and
// neither side ever lists the rows. A change of in-page order then costs one
// span per (page, layer, k|v, head) on the wire, not one per (token, head).
inline constexpr std::uint64_t kReqStrided = 8;
inline constexpr std::uint64_t kGatherMaxSpans = 4096;
// The messages of a gathered read, the same on both sides: runs [first,
// first + count) of whole units (spans, or strided spans) of at most
// kGatherBytes and kGatherMaxSpans rows in all, or one unit alone. A reader
// that stages (ucx_staging) receives each into a buffer of its own and
// refuses any other run. bytes(i) and rows(i) describe unit i.
template <class Bytes, class Rows>
std::vector<std::pair<std::size_t, std::size_t>> gather_groups(std::size_t units, Bytes bytes,
                                                               Rows rows) {
  std::vector<std::pair<std::size_t, std::size_t>> groups;
  for (std::size_t i = 0; i < units;) {
    std::size_t j = i;
    std::uint64_t b = 0;
    std::uint64_t r = 0;
    while (j < units &&
           (j == i || (b + bytes(j) <= kGatherBytes && r + rows(j) <= kGatherMaxSpans))) {
      b += bytes(j);
      r += rows(j);
      ++j;
    }
    groups.emplace_back(i, j - i);
    i = j;
  }
  return groups;
}

// Spans (strided spans, with kReqStrided) [first, first + count) of the
// request, `length` bytes in order.
struct GatherHdr {
  std::uint64_t batch_id;
  std::uint64_t first;
  std::uint64_t count;
  std::uint64_t length;
};

struct ReadyReqHdr {
  std::uint64_t watch_id;    // the reader's watch, echoed in the notice
  std::uint64_t generation;  // the region's generation the reader verified
  std::uint64_t epoch;       // the sequence's page epoch (nonzero)
  std::uint64_t floor;       // layers the reader knows are ready
  std::uint64_t npages;
  std::uint64_t ticket;
};
struct ReadyHdr {
  std::uint64_t watch_id;
  std::uint32_t layers;  // ready on every watched page (code 0)
  std::uint32_t code;    // 0, or the StatusCode failing the watch
};
// The most pages one watch names, and how long the owner holds a request
// whose count did not move before it answers anyway.
inline constexpr std::uint64_t kMaxReadyPages = 1u << 20;
inline constexpr unsigned kReadyHoldMs = 200;

struct WireSpan {
  std::uint64_t remote_offset;
  std::uint64_t length;
  std::uint64_t local_offset;
};
struct WireStrided {
  std::uint64_t remote_offset;
  std::uint64_t length;  // of one row
  std::uint64_t local_offset;
  std::uint64_t rows;
  std::uint64_t remote_stride;
  std::uint64_t local_stride;
};
struct DataHdr {
  std::uint64_t batch_id;
  std::uint64_t local_offset;
  std::uint64_t length;
};
struct ErrHdr {
  std::uint64_t batch_id;
  std::uint32_t code;
  std::uint32_t pad;
};

}  // namespace mstar::kv::ucx
