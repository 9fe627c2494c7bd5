// Copyright mstar-kv authors.
#include "bench_external.hpp"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include "bench_proc.hpp"
#include "mstar/kv/util/status.hpp"
#include "testkit/ports.hpp"

namespace mstar::kv::cli::bench {

namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using testkit::pick_port;
using testkit::tcp_port_listening;
using toolkit::find_program;

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& a : v) s += (s.empty() ? "" : " ") + a;
  return s;
}

// Removes the temporary files a run wrote, whatever happens.
class TempFiles {
 public:
  std::string make(const std::string& stem) {
    files_.push_back(temp_file(stem));
    return files_.back();
  }
  ~TempFiles() {
    for (const auto& f : files_) ::unlink(f.c_str());
  }

 private:
  std::vector<std::string> files_;
};

// Waits until `port` listens or the server exits; false on either failure.
bool wait_listening(Child& server, int port, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (tcp_port_listening(port)) return true;
    if (server.wait_for(milliseconds(0))) return false;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return false;
}

}  // namespace

ExternalResult run_ucx_perftest(const std::string& tls, const std::string& test,
                                std::uint64_t message_bytes) {
  ExternalResult r;
  if (find_program("ucx_perftest").empty()) {
    r.error = "ucx_perftest not found (Debian package ucx-utils)";
    return r;
  }
  // About 64 MiB of traffic: long enough to settle, short enough to repeat.
  const std::uint64_t iters =
      std::clamp<std::uint64_t>((64u << 20) / std::max<std::uint64_t>(1, message_bytes), 20, 20000);
  const std::map<std::string, std::string> env = {{"UCX_TLS", tls}, {"UCX_NET_DEVICES", "lo"}};
  TempFiles tmp;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int port = pick_port();
    SpawnOptions so;
    so.argv = {"ucx_perftest", "-p", std::to_string(port)};
    so.env = env;
    so.output_file = tmp.make("ucx-server");
    Child server(so);
    if (!wait_listening(server, port, milliseconds(5000))) {
      r.error = "ucx_perftest server did not listen on port " + std::to_string(port) + ": " +
                last_lines(read_file(so.output_file), 2);
      continue;
    }
    SpawnOptions co;
    co.argv = {"ucx_perftest", "127.0.0.1",
               "-p",           std::to_string(port),
               "-t",           test,
               "-s",           std::to_string(message_bytes),
               "-n",           std::to_string(iters)};
    co.env = env;
    co.output_file = tmp.make("ucx-client");
    r.command = "UCX_TLS=" + tls + " UCX_NET_DEVICES=lo " + join(co.argv);
    Child client(co);
    const auto rc = client.wait_for(milliseconds(60000));
    client.kill_and_reap();
    server.kill_and_reap();
    const std::string out = read_file(co.output_file);
    // "Final:  iters  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg  rate_overall"
    const auto pos = out.rfind("Final:");
    if (!rc || *rc != 0 || pos == std::string::npos) {
      r.error = std::string(rc ? "ucx_perftest failed" : "ucx_perftest timed out after 60 s") +
                ": " + last_lines(out, 2);
      continue;
    }
    std::istringstream ls(out.substr(pos + 6));
    double f[6] = {};
    for (double& x : f) ls >> x;
    if (!ls) {
      r.error = "cannot parse ucx_perftest's Final line";
      return r;
    }
    // ucx_perftest prints MB/s with MB = 2^20 bytes.
    r.gbps = f[5] * 1048576.0 / 1e9;
    r.ok = true;
    r.error.clear();
    return r;
  }
  return r;
}

ExternalResult run_iperf3(double seconds, std::uint64_t write_bytes) {
  ExternalResult r;
  if (find_program("iperf3").empty()) {
    r.error = "iperf3 not found (Debian package iperf3)";
    return r;
  }
  TempFiles tmp;
  const int port = pick_port();
  SpawnOptions so;
  so.argv = {"iperf3", "-s", "-1", "-p", std::to_string(port), "-B", "127.0.0.1"};
  so.output_file = tmp.make("iperf-server");
  Child server(so);
  if (!wait_listening(server, port, milliseconds(5000))) {
    r.error = "iperf3 server did not listen: " + last_lines(read_file(so.output_file), 2);
    return r;
  }
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", seconds);
  SpawnOptions co;
  co.argv = {"iperf3",
             "-c",
             "127.0.0.1",
             "-p",
             std::to_string(port),
             "-t",
             secs,
             "-l",
             std::to_string(write_bytes),
             "-J"};
  co.output_file = tmp.make("iperf-client");
  r.command = join(co.argv);
  Child client(co);
  const auto rc = client.wait_for(milliseconds(static_cast<long>(seconds * 1000) + 15000));
  client.kill_and_reap();
  server.kill_and_reap();
  const std::string out = read_file(co.output_file);
  const auto sum = out.find("\"sum_received\"");
  const auto key = sum == std::string::npos ? sum : out.find("\"bits_per_second\":", sum);
  if (!rc || *rc != 0 || key == std::string::npos) {
    r.error = std::string(rc ? "iperf3 failed" : "iperf3 timed out") + ": " + last_lines(out, 3);
    return r;
  }
  r.gbps = std::strtod(out.c_str() + key + 18, nullptr) / 8e9;
  r.ok = r.gbps > 0;
  if (!r.ok) r.error = "iperf3 reported no bandwidth";
  return r;
}

std::string find_mooncake_bench(std::string* why_not) {
  if (const char* env = std::getenv("MSTAR_KV_MOONCAKE_BENCH"); env != nullptr && *env != '\0') {
    if (::access(env, X_OK) == 0) return env;
    *why_not = std::string("MSTAR_KV_MOONCAKE_BENCH=") + env + " is not executable";
    return {};
  }
  if (find_program("python3").empty()) {
    *why_not = "python3 not found, so the mooncake package cannot be located";
    return {};
  }
  TempFiles tmp;
  SpawnOptions so;
  so.argv = {"python3", "-c", "import mooncake, os; print(os.path.dirname(mooncake.__file__))"};
  so.output_file = tmp.make("mooncake-find");
  Child py(so);
  const auto rc = py.wait_for(milliseconds(30000));
  py.kill_and_reap();
  const std::string out = read_file(so.output_file);
  if (!rc || *rc != 0) {
    *why_not = "Mooncake is not installed (python3 -c 'import mooncake' " +
               std::string(rc ? "failed: " + last_lines(out, 1) : "timed out") +
               "; pip install mooncake-transfer-engine-non-cuda)";
    return {};
  }
  std::string dir = last_lines(out, 1);
  const std::string bin = dir + "/transfer_engine_bench";
  if (::access(bin.c_str(), X_OK) != 0) {
    *why_not = "the mooncake package at " + dir + " has no transfer_engine_bench";
    return {};
  }
  return bin;
}

ExternalResult run_mooncake_bench(const std::string& binary, std::uint64_t block_bytes,
                                  std::uint32_t batch, std::uint32_t threads, int seconds) {
  ExternalResult r;
  TempFiles tmp;
  const std::vector<std::string> common = {"--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
                                           "--local_server_name=127.0.0.1",
                                           "--buffer_size=268435456", "--logtostderr=1"};
  if (block_bytes * batch * threads > 268435456ull) {
    r.error = "block x batch x threads exceeds the 256 MiB buffer";
    return r;
  }
  // Mooncake's own defaults, whatever this process set for its engine (the
  // mooncake engine sets MC_* variables in its process): INFO logs, which
  // carry the port and the result, and the wheel's TCP settings.
  const std::vector<std::string> unset = {"MC_TCP_ENABLE_CONNECTION_POOL", "MC_LOG_LEVEL",
                                          "GLOG_minloglevel"};
  SpawnOptions to;
  to.argv = {binary, "--mode=target"};
  to.argv.insert(to.argv.end(), common.begin(), common.end());
  to.unset_env = unset;
  to.output_file = tmp.make("mooncake-target");
  Child target(to);
  // The target logs "... P2P handshake, listening on 127.0.0.1:PORT" and then
  // "TcpTransport: listen on port N" once it can serve.
  static const std::regex listening("listening on (127\\.0\\.0\\.1:[0-9]+)");
  std::string peer;
  const auto deadline = Clock::now() + milliseconds(40000);
  while (Clock::now() < deadline) {
    const std::string log = read_file(to.output_file);
    std::smatch m;
    if (std::regex_search(log, m, listening) &&
        log.find("TcpTransport: listen") != std::string::npos) {
      peer = m[1];
      break;
    }
    if (target.wait_for(milliseconds(0))) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  if (peer.empty()) {
    r.error = "transfer_engine_bench target did not come up within 40 s: " +
              last_lines(read_file(to.output_file), 4);
    return r;
  }
  std::this_thread::sleep_for(milliseconds(500));
  SpawnOptions io;
  io.argv = {binary, "--mode=initiator"};
  io.argv.insert(io.argv.end(), common.begin(), common.end());
  for (const std::string& a :
       {"--segment_id=" + peer, std::string("--operation=read"),
        "--block_size=" + std::to_string(block_bytes), "--batch_size=" + std::to_string(batch),
        "--threads=" + std::to_string(threads), "--duration=" + std::to_string(seconds)}) {
    io.argv.push_back(a);
  }
  io.unset_env = unset;
  io.output_file = tmp.make("mooncake-initiator");
  r.command = join(io.argv);
  Child initiator(io);
  const auto rc = initiator.wait_for(milliseconds(seconds * 1000 + 30000));
  initiator.kill_and_reap();
  target.signal(SIGINT);
  if (!target.wait_for(milliseconds(5000))) target.kill_and_reap();
  const std::string out = read_file(io.output_file);
  static const std::regex done("Test completed:.*throughput ([0-9.]+) GB/s");
  std::smatch m;
  if (!rc || !std::regex_search(out, m, done)) {
    r.error = std::string(rc ? "transfer_engine_bench initiator failed" : "timed out") + ": " +
              last_lines(out, 2);
    return r;
  }
  // Its GB/s is 1e9 bytes per second (batches x batch x block / seconds).
  r.gbps = std::stod(m[1]);
  r.ok = true;
  return r;
}

ExternalResult run_nixl_peer(const std::string& tls, std::uint64_t block, std::uint32_t count,
                             std::uint32_t iters) {
  ExternalResult r;
  if (find_program("python3").empty()) {
    r.error = "python3 not found";
    return r;
  }
  TempFiles tmp;
  SpawnOptions so;
  so.argv = {"python3",
             MSTAR_KV_NIXL_PEER_PY,  // bench/mstar-kv-bench/nixl_peer.py (CMakeLists.txt)
             "initiator",
             std::to_string(block),
             std::to_string(count),
             std::to_string(iters)};
  // UCX_MODULES=^ib: the wheel's bundled libnl crashes processes at exit
  // otherwise (and there is no InfiniBand here).
  so.env = {{"UCX_TLS", tls}, {"UCX_NET_DEVICES", "lo"}, {"UCX_MODULES", "^ib"}};
  so.output_file = tmp.make("nixl");
  r.command = "UCX_TLS=" + tls + " nixl_peer.py initiator " + std::to_string(block) + " " +
              std::to_string(count) + " " + std::to_string(iters);
  Child peer(so);
  const auto rc = peer.wait_for(milliseconds(120000));
  const std::string out = read_file(so.output_file);
  static const std::regex gbps("GBPS ([0-9.]+)");
  static const std::regex error("ERROR ([^\n]*)");
  std::smatch m;
  if (rc && *rc == 0 && std::regex_search(out, m, gbps)) {
    r.gbps = std::stod(m[1]);
    r.ok = true;
  } else if (std::regex_search(out, m, error)) {
    r.error = "NIXL: " + std::string(m[1]);
  } else {
    r.error = std::string(rc ? "nixl_peer.py failed" : "nixl_peer.py timed out after 120 s") +
              ": " + last_lines(out, 3);
  }
  return r;
}

}  // namespace mstar::kv::cli::bench
