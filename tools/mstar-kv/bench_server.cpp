// Copyright mstar-kv authors.
#include "bench_server.hpp"
#include "mstar/kv/testing/pattern.hpp"

#include <unistd.h>

#include <map>
#include <sstream>

namespace mstar::kv::cli::bench {

namespace {

constexpr int kServerIn = 3;
constexpr int kServerOut = 4;

std::string encode_layout(const KVLayout& l) {
  std::ostringstream os;
  os << l.num_layers << ':' << l.num_pages << ':' << l.page_size << ':' << l.num_kv_heads << ':'
     << l.head_dim << ':' << static_cast<int>(l.dtype) << ':' << (l.has_v ? 1 : 0) << ':'
     << static_cast<int>(l.cache_order) << ':' << static_cast<int>(l.page_order) << ':'
     << l.total_kv_heads << ':' << l.first_kv_head;
  return os.str();
}

KVLayout decode_layout(const std::string& s) {
  std::vector<std::uint64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ':')) v.push_back(std::stoull(item));
  if (v.size() != 11) throw Error(StatusCode::kInvalidArgument, "bad layout '" + s + "'");
  KVLayout l;
  l.num_layers = static_cast<std::uint32_t>(v[0]);
  l.num_pages = static_cast<std::uint32_t>(v[1]);
  l.page_size = static_cast<std::uint32_t>(v[2]);
  l.num_kv_heads = static_cast<std::uint32_t>(v[3]);
  l.head_dim = static_cast<std::uint32_t>(v[4]);
  l.dtype = static_cast<DType>(v[5]);
  l.has_v = v[6] != 0;
  l.cache_order = static_cast<CacheOrder>(v[7]);
  l.page_order = static_cast<PageOrder>(v[8]);
  l.total_kv_heads = static_cast<std::uint32_t>(v[9]);
  l.first_kv_head = static_cast<std::uint32_t>(v[10]);
  l.validate();
  return l;
}

std::string encode_extra(const std::map<std::string, std::string>& m) {
  std::string s;
  for (const auto& [k, v] : m) s += (s.empty() ? "" : ";") + k + "=" + v;
  return s.empty() ? "-" : s;
}

std::map<std::string, std::string> decode_extra(const std::string& s) {
  std::map<std::string, std::string> m;
  if (s == "-") return m;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ';')) {
    const auto eq = item.find('=');
    if (eq != std::string::npos) m[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return m;
}

void send_reply(int fd, char status, const void* data, std::uint32_t n) {
  write_all(fd, &status, 1);
  write_all(fd, &n, sizeof n);
  if (n > 0) write_all(fd, data, n);
}

// One framed reply from the server: 'K' + bytes, or 'E' + status code + message.
std::vector<std::uint8_t> read_reply(Child& child, const std::string& log,
                                     std::chrono::milliseconds timeout, const std::string& what) {
  char status = 0;
  std::uint32_t n = 0;
  if (!read_exact(child.from_child(), &status, 1, timeout) ||
      !read_exact(child.from_child(), &n, sizeof n, timeout)) {
    const auto rc = child.wait_for(std::chrono::milliseconds(200));
    throw Error(StatusCode::kPeerFailure,
                "bench server gave no " + what + " within " + std::to_string(timeout.count()) +
                    " ms" + (rc ? " (it exited with status " + std::to_string(*rc) + ")" : "") +
                    "; its log: " + last_lines(read_file(log), 3));
  }
  std::vector<std::uint8_t> bytes(n);
  if (n > 0 && !read_exact(child.from_child(), bytes.data(), n, timeout)) {
    throw Error(StatusCode::kPeerFailure, "bench server's " + what + " was cut short");
  }
  if (status != 'K') {
    if (bytes.empty()) throw Error(StatusCode::kInternal, "bench server: empty error reply");
    throw Error(static_cast<StatusCode>(bytes[0]),
                "bench server: " + std::string(bytes.begin() + 1, bytes.end()));
  }
  return bytes;
}

SpawnOptions spawn_options(const EngineVariant& v, const Workload& w, const RunOptions& o,
                           const std::string& log) {
  std::map<std::string, std::string> extra = o.engine_extra;
  extra.insert(v.extra.begin(), v.extra.end());
  SpawnOptions s;
  s.argv = o.serve_argv;
  s.argv.insert(
      s.argv.end(),
      {"--internal-serve", v.engine, std::to_string(static_cast<int>(v.remote_kind)),
       encode_layout(w.remote), std::to_string(o.threads), std::to_string(o.timeout.count()),
       encode_extra(extra), v.layer_regions ? "layers" : "one"});
  s.env = v.env;
  s.output_file = log;
  s.in_fd = kServerIn;
  s.out_fd = kServerOut;
  return s;
}

}  // namespace

Server::LogFile::~LogFile() { ::unlink(path.c_str()); }

Server::Server(const EngineVariant& v, const Workload& w, const RunOptions& o)
    : log_(temp_file("server")), child_(spawn_options(v, w, o, log_.path)) {
  // Its descriptor, checked; reads name the sequences publish() returns.
  (void)KVTransferInfo::decode(
      read_reply(child_, log_.path, std::chrono::milliseconds(60000), "ready message"));
}

Server::~Server() {
  child_.close_to_child();  // EOF: the server shuts its engine down and exits
  if (!child_.wait_for(std::chrono::milliseconds(10000))) child_.kill_and_reap();
}

SequenceInfo Server::publish(std::uint64_t seq_id, std::uint64_t tokens,
                             const std::vector<std::uint32_t>& pages) {
  const std::uint64_t hdr[3] = {seq_id, tokens, kFillSeed};
  const auto n = static_cast<std::uint32_t>(pages.size());
  if (!write_all(child_.to_child(), hdr, sizeof hdr) ||
      !write_all(child_.to_child(), &n, sizeof n) ||
      !write_all(child_.to_child(), pages.data(), n * sizeof(std::uint32_t))) {
    throw Error(StatusCode::kPeerFailure, "bench server closed its command pipe");
  }
  return SequenceInfo::decode(
      read_reply(child_, log_.path, std::chrono::milliseconds(120000), "sequence"));
}

int serve_main(int argc, char** argv) {
  // An error reply carries the status code first, so that the client can
  // tell "cannot run here" (skipped) from a failure.
  auto fail = [](StatusCode code, const std::string& msg) {
    const std::string body = std::string(1, static_cast<char>(code)) + msg;
    send_reply(kServerOut, 'E', body.data(), static_cast<std::uint32_t>(body.size()));
    return 3;
  };
  if (argc != 7) {
    return fail(StatusCode::kInvalidArgument,
                "internal-serve: want ENGINE KIND LAYOUT THREADS TIMEOUT_MS EXTRA REGIONS");
  }
  try {
    const std::string engine = argv[0];
    const auto kind = static_cast<MemoryKind>(std::stoi(argv[1]));
    const KVLayout layout = decode_layout(argv[2]);
    EngineOptions eo;
    eo.max_workers = static_cast<std::uint32_t>(std::stoul(argv[3]));
    eo.timeout = std::chrono::milliseconds(std::stoll(argv[4]));
    eo.extra = decode_extra(argv[5]);
    LoopbackSetup setup;
    setup.owner_memory = kind;
    setup.layer_regions = std::string(argv[6]) == "layers";
    auto cache = make_loopback_cache(engine_traits(engine), setup, layout, /*owner=*/true);
    const std::string me = "bench-server-" + std::to_string(::getpid());
    KVTransferManager manager(TransferEngineInfo{me, "", engine, eo}, cache);
    const KVTransferInfo desc = manager.get_kv_transfer_info();
    const auto d = desc.encode();
    send_reply(kServerOut, 'K', d.data(), static_cast<std::uint32_t>(d.size()));
    const auto forever = std::chrono::hours(24);
    std::uint64_t epoch = static_cast<std::uint64_t>(::getpid()) << 32;
    for (;;) {
      std::uint64_t hdr[3];
      std::uint32_t n = 0;
      if (!read_exact(kServerIn, hdr, sizeof hdr, forever)) break;  // EOF: done
      if (!read_exact(kServerIn, &n, sizeof n, forever)) break;
      std::vector<std::uint32_t> pages(n);
      if (n > 0 && !read_exact(kServerIn, pages.data(), n * sizeof(std::uint32_t), forever)) break;
      if (host_accessible(cache->memory_kind())) {
        fill_pattern(*cache, hdr[2], pages, 0, hdr[1]);
      }
      // Stamped like a KVCachePool stamps an allocation, so that readers
      // check page epochs as they do in production.
      cache->epochs().stamp(pages, ++epoch);
      SequenceInfo si{hdr[0], hdr[1], pages, desc, 0, layout.page_size};
      si.kv_transfer_info.epoch = epoch;
      const auto bytes = si.encode();
      send_reply(kServerOut, 'K', bytes.data(), static_cast<std::uint32_t>(bytes.size()));
    }
    manager.cleanup();
    return 0;
  } catch (const Error& e) {
    return fail(e.code(), e.what());
  } catch (const std::exception& e) {
    return fail(StatusCode::kInternal, e.what());
  }
}

}  // namespace mstar::kv::cli::bench
