// Copyright mstar-kv authors.
//
// The UCX RmaBackend (see include/mstar/kv/engines/ucx.hpp for the behaviour).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/engine_options.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/util/log.hpp"
#include "rma/rma_backend.hpp"

namespace mstar::kv::ucx {

// See include/mstar/kv/engines/ucx.hpp ("ucx_mode").
enum class Mode : std::uint8_t { kAuto, kGet, kAm, kAmShm };
// See include/mstar/kv/engines/ucx.hpp ("ucx_progress").
enum class Progress : std::uint8_t { kAdaptive, kBusy, kEvent };
// See include/mstar/kv/engines/ucx.hpp ("ucx_staging").
enum class Staging : std::uint8_t { kAuto, kOn, kOff };

// ucx_am_proto=auto: replies of at least this many bytes go by rendezvous
// (over tcp 32 KiB replies ran at 2.3-2.5 GB/s that way, 1.6-1.7 eager;
// 16 KiB ones slower by rendezvous: they are gathered instead, kGatherBelowBytes).
inline constexpr std::uint64_t kAutoRndvBytes = 32u << 10;

struct UcxOptions {
  Mode mode = Mode::kAuto;
  // How the owner sends am replies: rendezvous (zero-copy: cma on shared
  // memory, one socket copy on tcp) for replies of at least rndv_bytes,
  // eager below (no handshake per small span).
  std::uint64_t rndv_bytes = kAutoRndvBytes;
  std::uint64_t chunk_bytes = 4u << 20;
  Progress progress = Progress::kAdaptive;
  Staging staging = Staging::kAuto;
  // extra["ucx_emulated_gets"] (on|off, MSTAR_KV_UCX_EMULATED_GETS): an
  // owner without an RDMA transport publishes its remote keys, so readers
  // may get (ucx_mode=get) through UCX 1.13's emulation over active
  // messages. Off by default: a reader that dies mid-get can abort such an
  // owner (tcp) or stall its receive fifo for every reader (shared memory).
  bool emulated_gets = false;
  // extra["ucx_peer_timeout_ms"]: a reader whose reads wait on an owner
  // that has sent nothing (no data, no answer to its pings) for this long
  // fails them as a dead peer (kPeerFailure), whatever the transfer
  // timeout. A SIGKILLed owner whose process has not finished exiting
  // keeps its sockets open, so neither TCP nor UCX sees it die; only its
  // silence does. 0: off (the transfer timeout alone bounds the wait).
  std::chrono::milliseconds peer_timeout{20000};
  // extra["auth_token"]: the shared secret of the connect handshake
  // (ucx_auth.hpp); empty: no authentication.
  std::string auth_token;
  Logger log;  // EngineOptions::log
  // Throws Error(kInvalidArgument) naming a bad key or value.
  static UcxOptions parse(const EngineOptions& options);
};

class UcxCore;  // context, worker, registration, listener, progress thread

class UcxBackend final : public rma::RmaBackend {
 public:
  // Registers the cache (a staged device cache: none), opens the listener
  // on `session_id` ("HOST:PORT"; empty: 127.0.0.1 and a free port in
  // 20000-29999) and starts the progress thread. Throws Error(kUnavailable)
  // when UCX cannot start or a device cache has no staging copier,
  // Error(kInvalidArgument) for a bad session id or options that cannot
  // serve the cache (ucx_staging=off or ucx_mode=get with staging).
  UcxBackend(std::shared_ptr<KVCache> cache, const std::string& entity_id,
             const std::string& session_id, const UcxOptions& options);
  ~UcxBackend() override;

  std::string_view engine_name() const noexcept override { return "ucx"; }
  rma::RmaRegionInfo local_region() const override;
  std::shared_ptr<rma::RmaPeer> connect(const rma::RmaRegionInfo& remote,
                                        std::chrono::milliseconds timeout) override;
  bool strided_reads() const noexcept override { return true; }
  void shutdown() noexcept override;
  void set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> handler) override;
  ServedStats served_stats() const override;

 private:
  friend struct UcxTestAccess;  // tests reach the core (tests/engines/ucx)
  std::shared_ptr<UcxCore> core_;
};

}  // namespace mstar::kv::ucx
