// Copyright mstar-kv authors.
//
// `mstar-kv serve` and `mstar-kv pull`: the two-host form of the demo.
//
// serve holds a cache, publishes demo requests (the pattern with a known
// seed) and answers an HTTP control plane (http_server.hpp: libmicrohttpd,
// keep-alive, bounded connections and timeouts, optional bearer token):
//   GET    /v1/sequences               ids being served (JSON)
//   GET    /v1/sequences/{id}          SequenceInfo::encode() bytes
//                                      (application/octet-stream)
//   GET    /v1/sequences/{id}/meta     seed, tokens and layout (JSON), what a
//                                      puller needs to build a cache and verify
//   POST   /v1/sequences/{id}/done     the puller is done: free the pages
//   DELETE /v1/sequences/{id}/done     same
//   GET    /metrics                    Prometheus text
// Unknown ids and paths answer 404 with a message, a known path with another
// method 405. With --token-file every request needs the bearer token (401
// without, 403 wrong); a non-loopback --listen needs a token or --insecure.
// The data plane is the engine's own (for ucx: its listener on --data-port,
// by default the HTTP port + 1); the token reaches the engine as
// EngineOptions.extra["auth_token"].
//
// pull (a cpp-httplib client) fetches a sequence, pulls it with
// KVTransferManager (N times), verifies every page against the pattern,
// prints GB/s, tells the server it is done, and exits non-zero with a clear
// message on any failure.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "demo_layerwise.hpp"
#include "http_auth.hpp"
#include "http_server.hpp"
#include "layout_args.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "serve_pull_layerwise.hpp"
#include "serve_pull_util.hpp"

namespace mstar::kv::cli {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kDefaultSeed = 0x5e7e0001;

MemoryKind memory_for(const std::string& engine) {
  const auto t = find_engine(engine);
  return t ? t->memory : MemoryKind::kHost;  // make_engine names an unknown engine
}

const char* kServeHelp =
    "usage: mstar-kv serve [options] [layout options]\n"
    "\n"
    "Holds a KV cache, publishes demo requests (sequence ids 0..N-1, filled with the\n"
    "pattern of seed S+id) and serves them over HTTP until interrupted:\n"
    "  GET /v1/sequences/{id}        SequenceInfo bytes (application/octet-stream)\n"
    "  GET /v1/sequences/{id}/meta   seed, tokens and layout (JSON)\n"
    "  POST|DELETE /v1/sequences/{id}/done   free the sequence's pages\n"
    "  GET /metrics                  Prometheus text: read statistics, what this owner\n"
    "                                served (reads and bytes over ucx, descriptors, done\n"
    "                                notices, readers gone), sequences live, free pages\n"
    "\n"
    "options:\n"
    "  --engine NAME       transfer engine (default ucx)\n"
    "  --listen HOST:PORT  HTTP address (default 127.0.0.1:23480); an address others can\n"
    "                      reach needs --token-file (or --insecure)\n"
    "  --token-file F      shared secret (>= 16 bytes, one line): every HTTP request\n"
    "                      needs 'Authorization: Bearer <secret>' (401 without, 403\n"
    "                      wrong); the engine gets it as extra auth_token\n"
    "  --insecure          allow a non-loopback --listen without a token\n"
    "  --http-threads N    HTTP event-loop threads (default 2)\n"
    "  --http-max-connections N  open HTTP connections at most (default 4096, within\n"
    "                      RLIMIT_NOFILE, which serve raises to its hard limit)\n"
    "  --http-header-timeout-s N close a connection whose next request line and headers\n"
    "                      are not all in N s after it opened or after its previous\n"
    "                      response, however slowly they trickle (default 10)\n"
    "  --http-idle-timeout-s N   close a connection silent for N s (default 10)\n"
    "  --data-port N       the engine's data port (default HTTP port + 1)\n"
    "  --data-host HOST    address peers use for data (default the --listen host)\n"
    "  --sequences N       demo requests to publish (default 1)\n"
    "  --tokens N          tokens per request (default 4096)\n"
    "  --seed S            pattern seed of request 0 (default 0x5e7e0001)\n"
    "  --scatter-seed N    shuffle the free pages (default 7; 0: contiguous)\n"
    "  --timeout-ms N      engine timeout (default 30000)\n"
    "  --extra K=V         engine option (repeatable as K=V,K=V)\n"
    "  --mooncake-lib PATH Mooncake's libtransfer_engine.so (--engine mooncake)\n"
    "  --lease-ms N        free a published sequence not marked done after N ms\n"
    "                      (default 60000; 0: never)\n"
    "  --exit-when-done    exit once every published sequence was marked done\n"
    "  --layerwise         layer-wise prefills on request (POST /v1/sequences/{id}/prefill,\n"
    "                      GET .../prefill waits for its timings; serve_pull_layerwise.hpp):\n"
    "                      each layer is written, then --prefill-ms-per-layer slept, then\n"
    "                      marked ready; for `pull --layerwise` (engines with a readiness\n"
    "                      channel: shm)\n"
    "  --prefill-ms-per-layer X  the prefill's compute per layer (default 1)\n";

const char* kPullHelp =
    "usage: mstar-kv pull --from HOST:PORT [options]\n"
    "\n"
    "Fetches a sequence from `mstar-kv serve`, pulls its KV cache into a local cache\n"
    "(N times), verifies every page against the pattern, prints GB/s and tells the\n"
    "server it is done. Exits non-zero with a message when anything fails.\n"
    "\n"
    "options:\n"
    "  --from HOST:PORT    the server's HTTP address (required)\n"
    "  --token-file F      the server's shared secret (sent as a bearer token; the\n"
    "                      engine gets it as extra auth_token)\n"
    "  --seq ID            sequence id (default 0)\n"
    "  --repeat N          pulls (default 1; the median is shown)\n"
    "  --engine NAME       transfer engine (default: the descriptor's)\n"
    "  --listen HOST:PORT  this process's data session (default: engine's choice)\n"
    "  --cache-order O     local cache order (default: the server's)\n"
    "  --page-order O      local in-page order (default: the server's)\n"
    "  --timeout-ms N      engine timeout per pull (default 30000)\n"
    "  --extra K=V         engine option (K=V,K=V)\n"
    "  --mooncake-lib PATH Mooncake's libtransfer_engine.so (--engine mooncake)\n"
    "  --keep              do not tell the server 'done'\n"
    "  --layerwise         against `serve --layerwise`: --repeat N rounds each of a\n"
    "                      streamed pull during the prefill and of a pull after it\n"
    "                      (alternating, default 5); prints the time from prefill start\n"
    "                      to all KV at decode for both and the fraction of the transfer\n"
    "                      hidden, as `demo --layerwise`\n";

}  // namespace

int cmd_serve(int argc, char** argv) {
  std::set<std::string> options = layout_options();
  for (const char* o : {"engine", "listen", "data-port", "data-host", "sequences", "tokens", "seed",
                        "scatter-seed", "timeout-ms", "extra", "mooncake-lib", "lease-ms",
                        "token-file", "http-threads", "http-max-connections", "http-idle-timeout-s",
                        "http-header-timeout-s", "prefill-ms-per-layer"}) {
    options.insert(o);
  }
  Args args(argc, argv, {"help", "exit-when-done", "insecure", "layerwise"}, options);
  if (args.flag("help")) {
    std::printf("%s\n%s", kServeHelp, layout_help());
    return 0;
  }
  const std::string engine = args.str("engine", "ucx");
  const bool layerwise = args.flag("layerwise");
  const double ms_per_layer = args.f64("prefill-ms-per-layer", 1.0);
  if (!layerwise && args.has("prefill-ms-per-layer")) {
    throw Error(StatusCode::kInvalidArgument, "--prefill-ms-per-layer needs --layerwise");
  }
  if (!(ms_per_layer >= 0 && ms_per_layer <= 10000)) {
    throw Error(
        StatusCode::kInvalidArgument,
        "--prefill-ms-per-layer " + args.str("prefill-ms-per-layer", "") + " is not in [0, 10000]");
  }
  if (layerwise) demo::require_layer_readiness(engine);
  const HostPort http = parse_host_port(args.str("listen", "127.0.0.1"), "--listen");
  const std::string token =
      args.has("token-file") ? read_token_file(args.str("token-file", "")) : std::string();
  if (token.empty() && !is_loopback_host(http.host) && !args.flag("insecure")) {
    throw Error(StatusCode::kInvalidArgument,
                "--listen " + http.host + ":" + std::to_string(http.port) +
                    " is not a loopback address: anyone who reaches it could read the cache; "
                    "give --token-file F (or --insecure to serve it without a token)");
  }
  const std::uint64_t data_port = args.u64("data-port", http.port + 1u);
  if (data_port == 0 || data_port > 65535) {
    throw Error(StatusCode::kInvalidArgument,
                "--data-port " + std::to_string(data_port) + " is not in [1, 65535]");
  }
  const std::string data_host = args.str("data-host", http.host);
  const std::uint64_t sequences = args.u64("sequences", 1);
  const std::uint64_t tokens = args.u64("tokens", 4096);
  const std::uint64_t seed = args.u64("seed", kDefaultSeed);
  if (sequences == 0 || sequences > 4096) {
    throw Error(StatusCode::kInvalidArgument,
                "--sequences " + std::to_string(sequences) + " is not in [1, 4096]");
  }
  if (tokens == 0) throw Error(StatusCode::kInvalidArgument, "--tokens 0: nothing to serve");
  // Enough pages for every request unless --pages says otherwise.
  const std::uint64_t page_size = args.u64("page-size", 16);
  const std::uint64_t pages_needed =
      page_size == 0 ? 1 : ((tokens + page_size - 1) / page_size) * sequences;
  if (pages_needed > LayoutLimits::kMaxPages) {
    throw Error(StatusCode::kInvalidArgument, std::to_string(sequences) + " requests of " +
                                                  std::to_string(tokens) + " tokens need " +
                                                  std::to_string(pages_needed) + " pages, limit " +
                                                  std::to_string(LayoutLimits::kMaxPages));
  }
  const KVLayout layout = layout_from_args(args, static_cast<std::uint32_t>(pages_needed));

  EngineOptions eo;
  eo.timeout = std::chrono::milliseconds(args.u64("timeout-ms", 30000));
  parse_extra(args, eo);
  if (!token.empty()) eo.extra["auth_token"] = token;
  SignalWaiter signals;  // before any thread starts
  // A restarted server must listen on its port again while its previous
  // connections sit in TIME_WAIT; the user's setting wins (no overwrite).
  ::setenv("UCX_TCP_CM_REUSEADDR", "y", 0);

  auto cache = make_kv_cache(layout, memory_for(engine));
  const std::string session = data_host + ":" + std::to_string(data_port);
  KVTransferManager manager(TransferEngineInfo{"serve", session, engine, eo}, cache);
  // A published sequence nobody marks done is freed after its lease (then
  // GET answers 404 and a reader still holding it fails with StaleDescriptor).
  KVCachePool pool(
      cache, manager.get_kv_transfer_info(), args.u64("scatter-seed", 7),
      std::chrono::milliseconds(
          args.u64("lease-ms", static_cast<std::uint64_t>(KVCachePool::kDefaultLease.count()))));
  for (std::uint64_t id = 0; id < sequences; ++id) {
    const auto pages = pool.allocate(id, tokens);
    fill_pattern(*cache, seed + id, pages, 0, tokens);
  }

  std::unique_ptr<LayerwiseOwner> prefills;
  if (layerwise) prefills = std::make_unique<LayerwiseOwner>(cache, pool, tokens, ms_per_layer);

  std::mutex mu;
  std::set<std::uint64_t> live;  // guarded by mu
  for (std::uint64_t id = 0; id < sequences; ++id) live.insert(id);
  std::atomic<bool> all_done{false};
  const bool exit_when_done = args.flag("exit-when-done");
  std::atomic<std::uint64_t> descriptors_served{0}, sequences_done{0};

  auto text = [](int status, std::string body) {
    HttpResponse r;
    r.status = status;
    r.body = std::move(body);
    return r;
  };
  auto not_served = [&](const std::string& id) {
    return text(404, "sequence '" + id + "' is not served here\n");
  };
  auto not_allowed = [&](const char* allow) {
    HttpResponse r = text(405, std::string("method not allowed; use ") + allow + "\n");
    r.headers.emplace_back("Allow", allow);
    return r;
  };
  auto list = [&] {
    std::lock_guard<std::mutex> lk(mu);
    std::string body = "{\"sequences\":[";
    bool first = true;
    for (std::uint64_t id : live) {
      if (!pool.contains(id)) continue;  // its lease ran out
      body += (first ? "" : ",") + std::to_string(id);
      first = false;
    }
    HttpResponse r = text(200, body + "]}\n");
    r.content_type = "application/json";
    return r;
  };
  auto descriptor = [&](std::uint64_t id) {
    if (prefills && prefills->running(id)) {
      return text(409, "sequence " + std::to_string(id) + " is being prefilled layer by layer\n");
    }
    const auto bytes = pool.publish(id).encode();
    descriptors_served.fetch_add(1, std::memory_order_relaxed);
    HttpResponse r = text(200, std::string(bytes.begin(), bytes.end()));
    r.content_type = "application/octet-stream";
    r.headers.emplace_back("X-Mstar-Kv-Seed", std::to_string(seed + id));
    return r;
  };
  auto meta = [&](std::uint64_t id) {
    HttpResponse r = text(
        200,
        "{\"seq_id\":" + std::to_string(id) + ",\"num_tokens\":" + std::to_string(tokens) +
            ",\"seed\":" + std::to_string(seed + id) + ",\"engine\":\"" + engine +
            "\",\"prefill_ms_per_layer\":" + (layerwise ? std::to_string(ms_per_layer) : "null") +
            ",\"layout\":" + layout_json(layout) + "}\n");
    r.content_type = "application/json";
    return r;
  };
  auto done = [&](std::uint64_t id) {
    pool.release(id);
    sequences_done.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lk(mu);
    live.erase(id);
    std::printf("sequence %llu done: %zu pages free\n", static_cast<unsigned long long>(id),
                pool.free_page_count());
    std::fflush(stdout);
    if (live.empty() && exit_when_done) all_done.store(true, std::memory_order_release);
    return text(200, "released sequence " + std::to_string(id) + "\n");
  };
  // Prometheus: the manager's read statistics (reads this process pulled),
  // what it served, and the owner's own families.
  auto metrics = [&] {
    std::size_t live_count = 0;
    {
      std::lock_guard<std::mutex> lk(mu);
      live_count = live.size();
    }
    const std::string labels = "{engine=\"" + engine + "\"}";
    std::string own =
        "# HELP mstar_kv_serve_descriptors_served_total SequenceInfo descriptors handed out.\n"
        "# TYPE mstar_kv_serve_descriptors_served_total counter\n"
        "mstar_kv_serve_descriptors_served_total" +
        labels + " " + std::to_string(descriptors_served.load()) +
        "\n# HELP mstar_kv_serve_sequences_done_total Sequences a reader marked done.\n"
        "# TYPE mstar_kv_serve_sequences_done_total counter\n"
        "mstar_kv_serve_sequences_done_total" +
        labels + " " + std::to_string(sequences_done.load()) +
        "\n# HELP mstar_kv_serve_sequences_live Sequences published and not yet done.\n"
        "# TYPE mstar_kv_serve_sequences_live gauge\n"
        "mstar_kv_serve_sequences_live" +
        labels + " " + std::to_string(live_count) +
        "\n# HELP mstar_kv_pool_free_pages Free pages in the served cache.\n"
        "# TYPE mstar_kv_pool_free_pages gauge\n"
        "mstar_kv_pool_free_pages" +
        labels + " " + std::to_string(pool.free_page_count()) + "\n";
    // The owner side (mstar_kv_served_*): what the engine served (ucx
    // counts its replies; shm readers never reach it) and this server's
    // descriptors and done notices.
    TransferStats st = manager.stats();
    st.served.descriptors = pool.published_count();
    st.served.done_notices = sequences_done.load();
    HttpResponse r = text(200, render_prometheus({st}, own));
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    return r;
  };
  auto route = [&](const HttpRequest& req) -> HttpResponse {
    const bool get = req.method == "GET";
    if (req.path == "/metrics") return get ? metrics() : not_allowed("GET");
    if (req.path == "/v1/sequences") return get ? list() : not_allowed("GET");
    constexpr std::string_view kPrefix = "/v1/sequences/";
    if (req.path.rfind(kPrefix, 0) != 0) return text(404, "no such path: " + req.path + "\n");
    std::string rest = req.path.substr(kPrefix.size());
    std::string tail;
    if (const auto slash = rest.find('/'); slash != std::string::npos) {
      tail = rest.substr(slash);
      rest.resize(slash);
    }
    std::uint64_t id = 0;
    if (tail != "" && tail != "/meta" && tail != "/done" && tail != "/prefill") {
      return text(404, "no such path: " + req.path + "\n");
    }
    if (!parse_id(rest, &id) || !pool.contains(id)) return not_served(rest);
    try {
      if (tail == "/done") {
        return req.method == "POST" || req.method == "DELETE" ? done(id)
                                                              : not_allowed("POST, DELETE");
      }
      if (tail == "/prefill") {
        return prefills ? prefills->route(req, id, seed + id)
                        : text(404, "this server runs without --layerwise\n");
      }
      if (!get) return not_allowed("GET");
      return tail.empty() ? descriptor(id) : meta(id);
    } catch (const Error& e) {
      // Its lease ran out, or another "done" won, since contains(): gone.
      if (e.code() == StatusCode::kNotFound || e.code() == StatusCode::kInvalidArgument ||
          e.code() == StatusCode::kStaleDescriptor) {
        return not_served(rest);
      }
      throw;
    }
  };

  HttpServerOptions ho;
  ho.host = http.host;
  ho.port = http.port;
  ho.threads = static_cast<unsigned>(args.u64("http-threads", ho.threads));
  ho.max_connections = static_cast<unsigned>(
      std::min<std::uint64_t>(args.u64("http-max-connections", ho.max_connections), 1u << 20));
  ho.header_timeout_s = static_cast<unsigned>(
      std::min<std::uint64_t>(args.u64("http-header-timeout-s", ho.header_timeout_s), 86400));
  ho.idle_timeout_s = static_cast<unsigned>(
      std::min<std::uint64_t>(args.u64("http-idle-timeout-s", ho.idle_timeout_s), 86400));
  ho.token = token;
  auto server = std::make_unique<HttpServer>(ho, route);
  std::printf("mstar-kv serve: engine '%s', %llu request(s) of %llu tokens, layout %s\n",
              engine.c_str(), static_cast<unsigned long long>(sequences),
              static_cast<unsigned long long>(tokens), layout.to_string().c_str());
  std::printf(
      "http control plane: %u thread(s), at most %u connections, header timeout %u s, "
      "idle timeout %u s, %s\n",
      ho.threads, server->max_connections(), ho.header_timeout_s, ho.idle_timeout_s,
      token.empty() ? "no token" : "bearer token required");
  std::printf("http://%s:%u/v1/sequences/{0..%llu}  data %s  seed %llu+id\n", http.host.c_str(),
              http.port, static_cast<unsigned long long>(sequences - 1), session.c_str(),
              static_cast<unsigned long long>(seed));
  if (layerwise) {
    std::printf(
        "layer-wise prefills on POST /v1/sequences/{id}/prefill: %.3f ms compute per "
        "layer, %u layers\n",
        ms_per_layer, layout.num_layers);
  }
  std::fflush(stdout);

  const bool signalled = signals.wait(all_done);
  server.reset();    // stops and joins its threads: no handler runs during cleanup
  prefills.reset();  // joins a prefill that still runs
  manager.cleanup();
  std::printf("mstar-kv serve: %s\n", signalled ? "interrupted, stopped" : "all sequences done");
  return 0;
}

int cmd_pull(int argc, char** argv) {
  Args args(argc, argv, {"help", "keep", "layerwise"},
            {"from", "seq", "repeat", "engine", "listen", "cache-order", "page-order", "timeout-ms",
             "extra", "mooncake-lib", "token-file"});
  if (args.flag("help")) {
    std::printf("%s", kPullHelp);
    return 0;
  }
  if (!args.has("from")) {
    throw Error(StatusCode::kInvalidArgument, "pull needs --from HOST:PORT (see --help)");
  }
  const HostPort from = parse_host_port(args.str("from", ""), "--from");
  const std::uint64_t seq_id = args.u64("seq", 0);
  const bool layerwise = args.flag("layerwise");
  const std::uint64_t repeat = args.u64("repeat", layerwise ? 5 : 1);
  if (repeat == 0 || repeat > 10000) {
    throw Error(StatusCode::kInvalidArgument,
                "--repeat " + std::to_string(repeat) + " is not in [1, 10000]");
  }
  const std::string base = "/v1/sequences/" + std::to_string(seq_id);
  const std::string token =
      args.has("token-file") ? read_token_file(args.str("token-file", "")) : std::string();

  httplib::Client http(from.host, from.port);
  http.set_tcp_nodelay(true);
  if (!token.empty()) http.set_bearer_token_auth(token.c_str());
  http.set_connection_timeout(5, 0);
  http.set_read_timeout(30, 0);
  http.set_write_timeout(30, 0);
  auto request = [&](const std::string& method, const std::string& path) {
    auto res =
        method == "POST" ? http.Post(path.c_str(), "", "text/plain") : http.Get(path.c_str());
    if (!res) {
      throw Error(StatusCode::kUnavailable, "cannot reach server http://" + from.host + ":" +
                                                std::to_string(from.port) + path + ": " +
                                                httplib::to_string(res.error()));
    }
    if (res->status == 404) {
      throw Error(StatusCode::kNotFound, "server says: " + res->body);
    }
    if (res->status == 401 || res->status == 403) {
      throw Error(StatusCode::kUnavailable,
                  method + " " + path + " refused with HTTP " + std::to_string(res->status) + " (" +
                      (res->status == 401 ? "the server needs a token: --token-file F"
                                          : "the server rejects the token of --token-file") +
                      "): " + res->body);
    }
    if (res->status != 200) {
      throw Error(StatusCode::kUnavailable, method + " " + path + " answered HTTP " +
                                                std::to_string(res->status) + ": " + res->body);
    }
    return res->body;
  };
  auto fetch = [&](const std::string& path) { return request("GET", path); };
  const std::string bytes = fetch(base);
  const SequenceInfo seq = SequenceInfo::decode(std::span<const std::uint8_t>(
      reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
  const std::string meta = fetch(base + "/meta");
  const std::uint64_t seed = json_u64(meta, "seed");
  if (json_u64(meta, "num_tokens") != seq.num_tokens || json_u64(meta, "seq_id") != seq.seq_id) {
    throw Error(StatusCode::kCorruptDescriptor,
                "server metadata does not match sequence " + std::to_string(seq_id));
  }
  const KVLayout layout =
      layout_from_meta(meta, args, static_cast<std::uint32_t>(seq.page_indices.size()));

  const std::string engine = args.str("engine", seq.kv_transfer_info.engine);
  if (engine.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "sequence " + std::to_string(seq_id) + " carries no transfer engine");
  }
  if (layerwise) demo::require_layer_readiness(engine);
  EngineOptions eo;
  eo.timeout = std::chrono::milliseconds(args.u64("timeout-ms", 30000));
  parse_extra(args, eo);
  if (!token.empty()) eo.extra["auth_token"] = token;
  auto cache = make_kv_cache(layout, memory_for(engine));
  KVTransferManager manager(TransferEngineInfo{"pull", args.str("listen", ""), engine, eo}, cache);
  // Local pages in reverse order: the pull scatters on this side too.
  std::vector<std::uint32_t> local(seq.page_indices.size());
  for (std::size_t i = 0; i < local.size(); ++i) {
    local[i] = static_cast<std::uint32_t>(local.size() - 1 - i);
  }
  std::printf("mstar-kv pull: sequence %llu from %s:%u, %llu tokens in %zu pages, engine '%s'\n",
              static_cast<unsigned long long>(seq.seq_id), from.host.c_str(), from.port,
              static_cast<unsigned long long>(seq.num_tokens), seq.page_indices.size(),
              engine.c_str());
  std::fflush(stdout);
  if (layerwise) {
    run_pull_layerwise(LayerwisePull{request, base, seed, static_cast<std::uint32_t>(repeat),
                                     &manager, cache.get(), local});
  } else {
    std::vector<double> gbps;
    std::uint64_t moved = 0;
    for (std::uint64_t r = 0; r < repeat; ++r) {
      std::memset(cache->base(), 0, cache->size_bytes());
      const auto t0 = Clock::now();
      try {
        moved =
            manager.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info);
      } catch (const Error& e) {
        throw Error(e.code(), "pull " + std::to_string(r + 1) + " of " + std::to_string(repeat) +
                                  " failed: " + e.what());
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      const VerifyResult v = verify_pattern(*cache, seed, local, 0, seq.num_tokens);
      if (!v.ok()) {
        throw Error(StatusCode::kInternal,
                    "pull " + std::to_string(r + 1) + ": " + std::to_string(v.mismatched_blocks) +
                        " of " + std::to_string(v.blocks_checked) +
                        " blocks differ from the pattern; first: " + v.first_mismatch);
      }
      gbps.push_back(static_cast<double>(moved) / s / 1e9);
      std::printf("  pull %llu: %.1f MiB in %.2f ms = %.2f GB/s, verified %llu blocks\n",
                  static_cast<unsigned long long>(r) + 1, moved / 1048576.0, s * 1e3, gbps.back(),
                  static_cast<unsigned long long>(v.blocks_checked));
      std::fflush(stdout);
    }
    std::vector<double> sorted = gbps;
    std::sort(sorted.begin(), sorted.end());
    std::printf("median %.2f GB/s over %llu pull(s) of %.1f MiB; every page verified\n",
                sorted[sorted.size() / 2], static_cast<unsigned long long>(repeat),
                moved / 1048576.0);
  }
  manager.cleanup();
  if (!args.flag("keep")) {
    auto res = http.Post((base + "/done").c_str(), "", "text/plain");
    if (!res || res->status != 200) {
      throw Error(StatusCode::kUnavailable,
                  "pulled and verified, but telling the server 'done' failed: " +
                      (res ? "HTTP " + std::to_string(res->status) + " " + res->body
                           : httplib::to_string(res.error())));
    }
  }
  std::printf("result: OK\n");
  return 0;
}

}  // namespace mstar::kv::cli
