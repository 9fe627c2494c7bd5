// Copyright mstar-kv authors.
//
// The UCX RmaBackend over UcxCore (ucx_core.hpp): its peers and operations,
// and UcxOptions.
#include <cstdlib>

#include "engines/option_keys.hpp"
#include "ucx_core.hpp"
#include "util/parse.hpp"

namespace mstar::kv::ucx {

// ---------------------------------------------------------------------------
// RmaPeer / RmaOperation / RmaBackend
// ---------------------------------------------------------------------------

namespace {

class UcxOperation final : public rma::RmaOperation {
 public:
  UcxOperation(std::weak_ptr<UcxCore> core, std::uint64_t id) : core_(std::move(core)), id_(id) {}
  void abort() noexcept override {
    if (auto core = core_.lock()) {
      UcxCore* c = core.get();
      const std::uint64_t id = id_;
      try {
        c->post([c, id] { c->reads().abort_batch(id); });
      } catch (...) {
        // Out of memory queuing the abort: the timeout or shutdown retries.
      }
    }
  }

 private:
  std::weak_ptr<UcxCore> core_;
  std::uint64_t id_;
};

class UcxPeer final : public rma::RmaPeer {
 public:
  UcxPeer(std::shared_ptr<UcxCore> core, std::shared_ptr<Conn> conn)
      : core_(std::move(core)), conn_(std::move(conn)) {}
  ~UcxPeer() override {
    UcxCore* c = core_.get();
    auto conn = conn_;
    c->post(
        [c, conn] { c->reader().close_conn(conn, Status(StatusCode::kCancelled, "released")); });
  }

  void verify(const rma::RmaRegionInfo& claimed) const override {
    rma::verify_region(conn_->served, claimed);
  }
  bool failed() const noexcept override { return conn_->failed.load(std::memory_order_acquire); }
  void send_done(std::uint64_t seq_id, std::uint64_t epoch) override {
    UcxCore* c = core_.get();
    auto conn = conn_;
    if (!c->post([c, conn, seq_id, epoch] {
          if (!conn->closing && conn->ep) c->reader().send_done(conn, seq_id, epoch);
        })) {
      throw Error(StatusCode::kShutdown, "the ucx engine is shut down");
    }
  }
  std::unique_ptr<LayerWatch> watch_layers(std::vector<std::uint32_t> pages, std::uint64_t epoch,
                                           std::uint32_t num_layers) override {
    return make_ready_watch(core_, conn_, std::move(pages), epoch, num_layers);
  }
  std::shared_ptr<rma::RmaOperation> post_reads(std::vector<rma::RmaRead> reads,
                                                rma::RmaCompletion done,
                                                rma::RmaEpochCheck check) override {
    auto b = new_batch(std::move(done), std::move(check));
    b->chunks = split_spans(reads, core_->options().chunk_bytes);
    return start(b);
  }
  // Many small rows in fewer strided spans (a change of in-page order or
  // head shard): one request names the spans, the owner gathers their rows
  // (kReqStrided). Otherwise, or over gets, the rows as post_reads posts them.
  std::shared_ptr<rma::RmaOperation> post_strided_reads(std::vector<StridedSpan> spans,
                                                        rma::RmaCompletion done,
                                                        rma::RmaEpochCheck check) override {
    std::uint64_t rows = 0;
    std::uint64_t bytes = 0;
    for (const StridedSpan& s : spans) {
      rows += s.rows;
      bytes += s.bytes();
    }
    if (spans.size() >= rows || rows > kMaxSpansPerRequest || rows < kGatherMinSpans ||
        bytes / rows >= kGatherBelowBytes) {
      return post_reads(
          strided_rows(spans, LayerBounds::of(core_->local_layout(), conn_->served.layout)),
          std::move(done), std::move(check));
    }
    // Never expanded here: the owner gathers each message's rows from the
    // spans, and the reader scatters them span by span (ucx_am.cpp).
    auto b = new_batch(std::move(done), std::move(check));
    b->strided = std::move(spans);
    return start(b);
  }

 private:
  std::shared_ptr<Batch> new_batch(rma::RmaCompletion done, rma::RmaEpochCheck check) {
    auto b = std::make_shared<Batch>();
    b->check = std::move(check);
    b->id = core_->reads().next_batch.fetch_add(1, std::memory_order_relaxed);
    b->conn = conn_;
    b->done = std::move(done);
    return b;
  }
  std::shared_ptr<rma::RmaOperation> start(const std::shared_ptr<Batch>& b) {
    UcxCore* c = core_.get();
    if (!c->post([c, b] { c->reads().start_batch(b); })) {
      throw Error(StatusCode::kShutdown, "the ucx engine is shut down");
    }
    return std::make_shared<UcxOperation>(core_, b->id);
  }

  std::shared_ptr<UcxCore> core_;
  std::shared_ptr<Conn> conn_;
};

using kv::engines::parse_on_off;

Staging parse_staging(const std::string& value, const char* what) {
  if (value == "auto") return Staging::kAuto;
  if (value == "on") return Staging::kOn;
  if (value == "off") return Staging::kOff;
  throw Error(StatusCode::kInvalidArgument,
              std::string(what) + " '" + value + "' is not one of auto, on, off");
}

}  // namespace

UcxOptions UcxOptions::parse(const EngineOptions& options) {
  UcxOptions o;
  o.log = options.log;
  // The option wins over the environment (MSTAR_KV_UCX_STAGING: test and
  // benchmark setups of a whole process).
  if (const char* env = std::getenv("MSTAR_KV_UCX_STAGING"); env != nullptr && *env != '\0') {
    o.staging = parse_staging(env, "MSTAR_KV_UCX_STAGING");
  }
  if (const char* env = std::getenv("MSTAR_KV_UCX_EMULATED_GETS"); env != nullptr && *env != '\0') {
    o.emulated_gets = parse_on_off(env, "MSTAR_KV_UCX_EMULATED_GETS");
  }
  for (const auto& [key, value] : options.extra) {
    if (key == "ucx_mode") {
      if (value == "auto")
        o.mode = Mode::kAuto;
      else if (value == "get")
        o.mode = Mode::kGet;
      else if (value == "am")
        o.mode = Mode::kAm;
      else if (value == "am_shm")
        o.mode = Mode::kAmShm;
      else
        throw Error(StatusCode::kInvalidArgument,
                    "ucx_mode '" + value + "' is not one of auto, get, am, am_shm");
    } else if (key == "ucx_am_proto") {
      if (value == "eager")
        o.rndv_bytes = ~std::uint64_t{0};
      else if (value == "rndv")
        o.rndv_bytes = 0;
      else if (value == "auto")
        o.rndv_bytes = kAutoRndvBytes;
      else
        throw Error(StatusCode::kInvalidArgument,
                    "ucx_am_proto '" + value + "' is not one of auto, eager, rndv");
    } else if (key == "ucx_chunk_bytes") {
      o.chunk_bytes = util::parse_u64(value, "ucx_chunk_bytes", 4096, 1ull << 30);
    } else if (key == "ucx_progress") {
      if (value == "adaptive")
        o.progress = Progress::kAdaptive;
      else if (value == "busy")
        o.progress = Progress::kBusy;
      else if (value == "event")
        o.progress = Progress::kEvent;
      else
        throw Error(StatusCode::kInvalidArgument,
                    "ucx_progress '" + value + "' is not one of adaptive, busy, event");
    } else if (key == "ucx_staging") {
      o.staging = parse_staging(value, "ucx_staging");
    } else if (key == "ucx_emulated_gets") {
      o.emulated_gets = parse_on_off(value, "ucx_emulated_gets");
    } else if (key == "ucx_peer_timeout_ms") {
      // 0 (off), or at least a few ping rounds (check_peers pings every
      // quarter of it).
      const std::uint64_t ms = util::parse_u64(value, "ucx_peer_timeout_ms", 0, 3600000);
      if (ms != 0 && ms < 200) {
        throw Error(
            StatusCode::kInvalidArgument,
            "ucx_peer_timeout_ms " + value + " is below 200 (0 turns it off; at most 3600000)");
      }
      o.peer_timeout = std::chrono::milliseconds(ms);
    } else if (key == auth::kTokenKey) {
      o.auth_token = auth::token_from(options.extra);
    } else if (key.rfind("ucx_", 0) == 0) {
      throw Error(StatusCode::kInvalidArgument, "unknown UCX option '" + key +
                                                    "' (known: ucx_mode, ucx_am_proto, "
                                                    "ucx_chunk_bytes, ucx_progress, ucx_staging, "
                                                    "ucx_emulated_gets, ucx_peer_timeout_ms)");
    }
    // Keys of other engines are ignored: one EngineOptions may serve several.
  }
  return o;
}

UcxBackend::UcxBackend(std::shared_ptr<KVCache> cache, const std::string& entity_id,
                       const std::string& session_id, const UcxOptions& options)
    : core_(std::make_shared<UcxCore>(std::move(cache), entity_id, session_id, options)) {}

UcxBackend::~UcxBackend() { shutdown(); }

rma::RmaRegionInfo UcxBackend::local_region() const { return core_->region(); }

std::shared_ptr<rma::RmaPeer> UcxBackend::connect(const rma::RmaRegionInfo& remote,
                                                  std::chrono::milliseconds timeout) {
  auto conn = core_->reader().connect(remote, timeout);
  return std::make_shared<UcxPeer>(core_, std::move(conn));
}

void UcxBackend::shutdown() noexcept { core_->stop(); }

void UcxBackend::set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> handler) {
  core_->owner().set_done_handler(std::move(handler));
}

ServedStats UcxBackend::served_stats() const { return core_->owner().served_stats(); }

}  // namespace mstar::kv::ucx
