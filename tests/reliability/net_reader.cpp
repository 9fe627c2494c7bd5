// Copyright mstar-kv authors.
//
// net_reader: the reader of the network fault tests (netfault_test.cpp), a
// decode process that pulls one sequence from `mstar-kv serve` again and
// again, in one process and through one manager, while the test breaks the
// network under it, and reports what each pull did.
//
// It fetches the sequence over serve's HTTP control plane
// (GET /v1/sequences/{id} and .../meta) with the public API only:
// SequenceInfo::decode, KVTransferManager, verify_pattern.
//
// Usage: net_reader --from HOST:PORT --seq N --timeout-ms T --grace-ms G
//                   [--token-file F] [--listen HOST:PORT]
// Prints "READY <bytes>" (the sequence's bytes), or "FAIL fetch ..." and
// exits 1. Commands on stdin, one a line:
//   pull [P]   zeroes the cache, starts a pull of the whole sequence and
//              prints "STARTED"; with P > 0 also "LANDED P" once about P% of
//              the cache holds bytes (sampled every 2 ms). Then one of
//                OK ms=M bytes=B blocks=N          every block verified
//                CORRUPT ms=M mismatched=X/N first=...   (a defect)
//                FAIL ms=M code=C landed=L% late=Z error=...
//              For FAIL the cache is copied when the future resolves and
//              compared again after the grace period: late=Z counts the
//              bytes that changed meanwhile (a byte landing after a failed
//              future: must be 0); landed is how much of the cache held bytes
//              at the failure (so a test can tell a read cut in its middle).
//   fetch      the descriptor again over HTTP: "FETCHED" or "FAIL fetch ...".
//   quit       cleans up the manager and exits 0.
#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace {

using namespace mstar::kv;
using Clock = std::chrono::steady_clock;

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::string arg(int argc, char** argv, const std::string& name, const std::string& def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return def;
}

// The value after "key": in serve's flat /meta JSON (strings unquoted).
std::string json_value(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\":");
  if (at == std::string::npos) throw Error(StatusCode::kCorruptDescriptor, "meta lacks " + key);
  std::size_t i = at + key.size() + 3;
  if (json[i] == '"') return json.substr(i + 1, json.find('"', i + 1) - i - 1);
  std::size_t end = i;
  while (end < json.size() && json[end] != ',' && json[end] != '}') ++end;
  return json.substr(i, end - i);
}
std::uint32_t json_u32(const std::string& json, const std::string& key) {
  return static_cast<std::uint32_t>(std::stoul(json_value(json, key)));
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

struct Sequence {
  SequenceInfo info;
  std::uint64_t seed = 0;
  KVLayout layout;
};

class Reader {
 public:
  Reader(int argc, char** argv)
      : http_(host(arg(argc, argv, "from", "")), port(arg(argc, argv, "from", ""))),
        seq_id_(arg(argc, argv, "seq", "0")),
        timeout_ms_(std::stoul(arg(argc, argv, "timeout-ms", "5000"))),
        grace_ms_(std::stoul(arg(argc, argv, "grace-ms", "2000"))),
        listen_(arg(argc, argv, "listen", "")) {
    http_.set_connection_timeout(5, 0);
    http_.set_read_timeout(10, 0);
    http_.set_write_timeout(10, 0);
    const std::string token_file = arg(argc, argv, "token-file", "");
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      std::getline(in, token_);
      http_.set_bearer_token_auth(token_.c_str());
    }
  }

  // GET the descriptor and meta; throws Error naming what failed.
  void fetch() {
    const std::string base = "/v1/sequences/" + seq_id_;
    const std::string bytes = get(base);
    const std::string meta = get(base + "/meta");
    seq_.info = SequenceInfo::decode(std::span<const std::uint8_t>(
        reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
    seq_.seed = std::stoull(json_value(meta, "seed"));
    KVLayout l;
    const std::string lj = meta.substr(meta.find("\"layout\":"));
    l.num_layers = json_u32(lj, "num_layers");
    l.page_size = json_u32(lj, "page_size");
    l.num_kv_heads = json_u32(lj, "num_kv_heads");
    l.head_dim = json_u32(lj, "head_dim");
    l.dtype = parse_dtype(json_value(lj, "dtype"));
    l.has_v = json_value(lj, "has_v") == "true";
    l.cache_order = parse_cache_order(json_value(lj, "cache_order"));
    l.page_order = parse_page_order(json_value(lj, "page_order"));
    l.num_pages = static_cast<std::uint32_t>(seq_.info.page_indices.size());
    l.validate();
    seq_.layout = l;
    if (!manager_) {
      EngineOptions eo;
      eo.timeout = std::chrono::milliseconds(timeout_ms_);
      if (!token_.empty()) eo.extra["auth_token"] = token_;
      cache_ = make_kv_cache(l, MemoryKind::kHost);
      manager_ = std::make_unique<KVTransferManager>(
          TransferEngineInfo{"net_reader", listen_, seq_.info.kv_transfer_info.engine, eo}, cache_);
      local_.resize(l.num_pages);
      for (std::uint32_t i = 0; i < l.num_pages; ++i) local_[i] = l.num_pages - 1 - i;
    }
  }

  std::size_t bytes() const { return cache_->size_bytes(); }

  void pull(int landed_pct) {
    auto* base = reinterpret_cast<unsigned char*>(cache_->base());
    const std::size_t size = cache_->size_bytes();
    std::memset(base, 0, size);
    const auto t0 = Clock::now();
    std::optional<TransferFuture> f;
    try {
      f = manager_->start_async_retrieve(0, seq_.info.num_tokens, local_, seq_.info.page_indices,
                                         seq_.info.kv_transfer_info);
    } catch (const Error& e) {  // refused before any byte moved (a connect that failed)
      say("STARTED");
      report_failure(t0, e.status());
      return;
    }
    say("STARTED");
    bool landed_said = landed_pct <= 0;
    while (!f->wait_for(std::chrono::milliseconds(2))) {
      if (!landed_said && landed_percent(base, size, 4096) >= landed_pct) {
        say("LANDED " + std::to_string(landed_pct));
        landed_said = true;
      }
    }
    const Status st = f->status();
    if (!st.is_ok()) {
      report_failure(t0, st);
      return;
    }
    const double ms = ms_since(t0);
    const VerifyResult v = verify_pattern(*cache_, seq_.seed, local_, 0, seq_.info.num_tokens);
    if (!v.ok()) {
      say("CORRUPT ms=" + std::to_string(ms) +
          " mismatched=" + std::to_string(v.mismatched_blocks) + "/" +
          std::to_string(v.blocks_checked) + " first=" + one_line(v.first_mismatch));
      return;
    }
    say("OK ms=" + std::to_string(ms) + " bytes=" + std::to_string(f->bytes()) +
        " blocks=" + std::to_string(v.blocks_checked));
  }

  void cleanup() {
    if (manager_) manager_->cleanup();
  }

 private:
  static std::string host(const std::string& hp) { return hp.substr(0, hp.rfind(':')); }
  static int port(const std::string& hp) { return std::stoi(hp.substr(hp.rfind(':') + 1)); }
  static double ms_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  }
  // Percent of sampled 8-byte words (every `stride` bytes) that are not zero.
  static int landed_percent(const unsigned char* base, std::size_t size, std::size_t stride) {
    std::size_t seen = 0, set = 0;
    for (std::size_t off = 0; off + 8 <= size; off += stride, ++seen) {
      std::uint64_t w = 0;
      std::memcpy(&w, base + off, 8);
      set += w != 0 ? 1 : 0;
    }
    return seen == 0 ? 0 : static_cast<int>(set * 100 / seen);
  }

  std::string get(const std::string& path) {
    auto res = http_.Get(path.c_str());
    if (!res) {
      throw Error(StatusCode::kUnavailable, "GET " + path + ": " + httplib::to_string(res.error()));
    }
    if (res->status != 200) {
      throw Error(StatusCode::kUnavailable,
                  "GET " + path + " answered HTTP " + std::to_string(res->status));
    }
    return res->body;
  }

  void report_failure(Clock::time_point t0, const Status& st) {
    const double ms = ms_since(t0);
    auto* base = reinterpret_cast<const unsigned char*>(cache_->base());
    const std::size_t size = cache_->size_bytes();
    const std::vector<unsigned char> snapshot(base, base + size);
    const int landed = landed_percent(snapshot.data(), size, 64);
    std::this_thread::sleep_for(std::chrono::milliseconds(grace_ms_));
    std::size_t late = 0;
    for (std::size_t i = 0; i < size; ++i) late += base[i] != snapshot[i] ? 1 : 0;
    say("FAIL ms=" + std::to_string(ms) + " code=" + std::string(to_string(st.code())) +
        " landed=" + std::to_string(landed) + "% late=" + std::to_string(late) +
        " error=" + one_line(st.message()));
  }

  httplib::Client http_;
  std::string seq_id_;
  unsigned long timeout_ms_, grace_ms_;
  std::string listen_, token_;
  Sequence seq_;
  std::shared_ptr<KVCache> cache_;
  std::unique_ptr<KVTransferManager> manager_;
  std::vector<std::uint32_t> local_;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    Reader reader(argc, argv);
    try {
      reader.fetch();
    } catch (const std::exception& e) {
      say(std::string("FAIL fetch ") + one_line(e.what()));
      return 1;
    }
    say("READY " + std::to_string(reader.bytes()));
    for (std::string line; std::getline(std::cin, line);) {
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      if (cmd == "pull") {
        int pct = 0;
        in >> pct;
        reader.pull(pct);
      } else if (cmd == "fetch") {
        try {
          reader.fetch();
          say("FETCHED");
        } catch (const std::exception& e) {
          say(std::string("FAIL fetch ") + one_line(e.what()));
        }
      } else if (cmd == "quit") {
        break;
      } else {
        say("ERR unknown command '" + cmd + "'");
      }
    }
    reader.cleanup();
  } catch (const std::exception& e) {
    say(std::string("ERR ") + one_line(e.what()));
    return 1;
  }
  return 0;
}
