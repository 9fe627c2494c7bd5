// Copyright mstar-kv authors.
//
// UcxWorker, the ucx engine's UCP objects over one local cache (internal to
// the engine). It owns the UCP context and worker, the cache's memory
// registrations and the region it publishes (its session id set once by
// the owner's side, before the progress thread starts), the datatypes of
// gathered rows, the active-message handlers, the contexts of requests in
// flight (their user_data, ucx_callback.hpp), the control messages it
// sends and the endpoints being closed.
// Threads: made and released (release()) by UcxCore while no progress
// thread runs; the const accessors from any thread after that; the rest
// on the progress thread only.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rma/rma_engine.hpp"
#include "ucx_backend.hpp"
#include "ucx_callback.hpp"
#include "ucx_handles.hpp"
#include "ucx_part.hpp"
#include "ucx_rows.hpp"
#include "ucx_state.hpp"
#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

// The lines a UCX dump writes (`print` gets the stream: ucp_ep_print_info,
// ucp_context_print_info), without their newlines; none if no stream opens.
// UCX 1.13 answers some questions (which transports carry an endpoint's
// lanes, whether a context has RDMA) only in these dumps.
std::vector<std::string> printed_lines(const std::function<void(FILE*)>& print);

// The remote keys of a cache of one region per layer in one backend blob
// (ucx.hpp: u32 count, then u32 length and the key's bytes each), and back:
// unpack_rkeys checks the blob as untrusted (exactly `count` keys, every
// length inside it) and throws Error(kCorruptDescriptor) naming what is
// wrong; the spans point into `blob`.
std::vector<std::uint8_t> pack_rkeys(const std::vector<std::vector<std::uint8_t>>& keys);
std::vector<std::span<const std::uint8_t>> unpack_rkeys(std::span<const std::uint8_t> blob,
                                                        std::size_t count);

struct AmTag {  // argument of the active-message handler for one id
  UcxCore* core = nullptr;
  unsigned id = 0;
};

class UcxWorker : private UcxPart {
 public:
  // Registers the cache (a device cache: not at all, it is only staged),
  // publishes its remote keys where gets may be served, and routes every
  // active message to UcxCore::on_am. Throws Error(kUnavailable) when UCX
  // cannot start.
  UcxWorker(UcxCore& core, std::shared_ptr<KVCache> cache, const std::string& entity_id,
            const UcxOptions& options);

  ucp_worker_h get() const noexcept { return worker_.get(); }
  int efd() const noexcept { return efd_; }  // -1: no event fd (the loop polls)
  const rma::RmaRegionInfo& region() const noexcept { return region_; }
  // The listener's "HOST:PORT" (UcxOwner, before the progress thread starts).
  void set_session(std::string session_id) { region_.session_id = std::move(session_id); }
  // Sent in the hello reply; empty for a device cache (no gets).
  const std::vector<std::uint8_t>& address() const noexcept { return worker_address_; }
  // A cache of one region per layer: each region's bytes (0: one region).
  std::uint64_t layer_bytes() const noexcept { return layer_bytes_; }
  // The registration holding the byte at layout offset `offset`.
  ucp_mem_h memh_at(std::uint64_t offset) const noexcept {
    return layer_bytes_ == 0 ? memhs_.front().get() : memhs_[offset / layer_bytes_].get();
  }
  ucp_datatype_t rows_dt() const noexcept { return rows_dt_.get(); }  // strided spans' rows
  ucp_datatype_t sink_dt() const noexcept { return sink_dt_.get(); }  // gathered replies

  // [progress] The contexts of requests in flight: gets and receives, data
  // replies, control messages. What UCX never completes (written off, see
  // UcxReader::close_conn) is destroyed by release(), after the worker.
  InFlight<ReqCtx>& read_requests() noexcept { return reads_; }
  InFlight<SendCtx>& send_requests() noexcept { return sends_; }
  InFlight<Control>& control_requests() noexcept { return controls_; }
  bool sending() const noexcept { return !sends_.empty(); }  // data replies in flight

  // [progress] Sends a small message whose header and data are copied into
  // a block that lives until the send completes. A reader's message names
  // its connection (`conn`, else 0): its failure, at once or in its
  // completion, fails the connection (UcxReader::message_failed).
  void send_small(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_len,
                  const void* data, std::size_t data_len, bool reply, std::uint64_t conn = 0);
  // [progress] Closes `ep` by force; `rkeys` and `keep` (the error
  // handler's argument) live until the close completes.
  void close_ep(Endpoint ep, std::vector<RemoteKey> rkeys, std::shared_ptr<Conn> keep);
  // [progress] Forgets the closes that completed (all of them: `force`).
  void reap_closing(bool force);
  bool closing() const noexcept { return !closing_.empty(); }  // [progress]
  // Releases the registrations, the worker and the context, then what UCX
  // left in flight (nothing can complete or write any more). Called once
  // the progress thread ended and the endpoints were dropped.
  void release() noexcept;

 private:
  void init_ucp();
  static void on_control_sent(void* request, ucs_status_t st, void* user_data);

  // Destroyed after the worker (declared before it): UCX may write through
  // them until then.
  InFlight<ReqCtx> reads_;
  InFlight<SendCtx> sends_;
  InFlight<Control> controls_;
  // In creation order: destroyed in reverse (ucx_handles.hpp).
  Context context_;
  Worker worker_;
  std::vector<MemReg> memhs_;      // one per region (regions.hpp)
  std::uint64_t layer_bytes_ = 0;  // a cache of one region per layer: each region's bytes
  RowDatatype rows_dt_;            // strided spans' rows, packed from the pages (ucx_rows.hpp)
  RowDatatype sink_dt_;            // gathered replies, unpacked into the pages
  int efd_ = -1;
  rma::RmaRegionInfo region_;
  std::vector<std::uint8_t> worker_address_;  // sent in the hello reply
  AmTag am_tags_[kAmMaxId + 1];
  struct Closing {                 // an endpoint's close in flight
    std::vector<RemoteKey> rkeys;  // destroyed after the request is freed
    Request request;
    std::shared_ptr<Conn> conn;  // keeps the error-handler argument alive
  };
  std::vector<Closing> closing_;  // [progress]
};

}  // namespace mstar::kv::ucx
