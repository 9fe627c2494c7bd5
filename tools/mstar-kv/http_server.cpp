// Copyright mstar-kv authors.
#include "http_server.hpp"

#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_set>

#include "http_auth.hpp"
#include "mstar/kv/util/status.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv::cli {

namespace {

constexpr std::int64_t kNoDeadline = std::numeric_limits<std::int64_t>::max();

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One TCP connection, from libmicrohttpd's STARTED notice to its CLOSED one.
struct Tracked {
  int fd = -1;
  // By when the next request's line and headers must be in (steady clock,
  // ns); kNoDeadline while a request is being served.
  std::atomic<std::int64_t> deadline_ns{kNoDeadline};
};

}  // namespace

struct HttpServer::Impl {
  HttpServerOptions options;
  Handler handler;
  MHD_Daemon* daemon = nullptr;
  int listen_fd = -1;

  // The header deadline: libmicrohttpd's own timeout counts silence only,
  // so a client trickling a byte now and then would hold its connection
  // for ever. The reaper shuts down (never closes: the descriptor stays
  // libmicrohttpd's) a connection past its deadline; libmicrohttpd then
  // reads EOF and closes it, notifying CLOSED before it closes the socket,
  // and CLOSED takes `mu`, so a shut-down descriptor is never a reused one.
  std::mutex mu;
  std::unordered_set<Tracked*> tracked MSTAR_KV_GUARDED_BY(mu);
  bool stopping MSTAR_KV_GUARDED_BY(mu) = false;
  std::condition_variable wake;
  std::thread reaper;

  std::int64_t header_deadline() const {
    return now_ns() + static_cast<std::int64_t>(options.header_timeout_s) * 1000000000;
  }
  void reap() {
    internal::UniqueLock lk(mu);
    while (!stopping) {
      wake.wait_for(lk, std::chrono::milliseconds(100));
      const std::int64_t now = now_ns();
      for (Tracked* t : tracked) {
        // Only the deadline read here: one that a request just cleared or
        // a response just set anew stands.
        std::int64_t d = t->deadline_ns.load(std::memory_order_relaxed);
        if (d <= now &&
            t->deadline_ns.compare_exchange_strong(d, kNoDeadline, std::memory_order_relaxed)) {
          ::shutdown(t->fd, SHUT_RDWR);
        }
      }
    }
  }
};

namespace {

Tracked* tracked_of(MHD_Connection* c) {
  const MHD_ConnectionInfo* ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  return ci == nullptr ? nullptr : static_cast<Tracked*>(ci->socket_context);
}

void on_connection(void* cls, MHD_Connection* c, void** socket_context,
                   MHD_ConnectionNotificationCode toe) {
  auto* impl = static_cast<HttpServer::Impl*>(cls);
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    const MHD_ConnectionInfo* ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci == nullptr) return;
    auto* t = new Tracked;
    t->fd = ci->connect_fd;
    t->deadline_ns.store(impl->header_deadline(), std::memory_order_relaxed);
    std::lock_guard<std::mutex> lk(impl->mu);
    impl->tracked.insert(t);
    *socket_context = t;
  } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
    auto* t = static_cast<Tracked*>(*socket_context);
    if (t == nullptr) return;
    {
      std::lock_guard<std::mutex> lk(impl->mu);
      impl->tracked.erase(t);
    }
    delete t;
    *socket_context = nullptr;
  }
}

// Per-request state between libmicrohttpd's calls of the access handler.
struct RequestState {
  std::size_t body_bytes = 0;
};

// How much of a chunked body over the limit is read (and dropped) so that
// the client can be told 413; past it the connection is closed.
constexpr std::size_t kDiscardBytes = 64 * 1024;

MHD_Result respond(MHD_Connection* c, const HttpResponse& r) {
  // One buffer, copied: libmicrohttpd writes headers and body together.
  MHD_Response* resp = MHD_create_response_from_buffer(
      r.body.size(), const_cast<char*>(r.body.data()), MHD_RESPMEM_MUST_COPY);
  if (resp == nullptr) return MHD_NO;
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r.content_type.c_str());
  for (const auto& [k, v] : r.headers) MHD_add_response_header(resp, k.c_str(), v.c_str());
  const MHD_Result ok = MHD_queue_response(c, static_cast<unsigned>(r.status), resp);
  MHD_destroy_response(resp);
  return ok;
}

HttpResponse plain(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

// 0 when the request may proceed, else the refusal (401 or 403).
int check_bearer(MHD_Connection* c, const std::string& token) {
  const char* h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (h == nullptr) return 401;
  std::string_view v(h);
  constexpr std::string_view kScheme = "bearer ";
  if (v.size() < kScheme.size()) return 401;
  for (std::size_t i = 0; i < kScheme.size(); ++i) {
    if (static_cast<char>(std::tolower(static_cast<unsigned char>(v[i]))) != kScheme[i]) {
      return 401;
    }
  }
  v.remove_prefix(kScheme.size());
  while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  if (v.empty()) return 401;  // "Bearer" and no token: none given
  return constant_time_equal(v, token) ? 0 : 403;
}

MHD_Result on_request(void* cls, MHD_Connection* c, const char* url, const char* method,
                      const char* /*version*/, const char* /*upload_data*/,
                      std::size_t* upload_data_size, void** con_cls) {
  auto* impl = static_cast<HttpServer::Impl*>(cls);
  const HttpServerOptions& o = impl->options;
  if (*con_cls == nullptr) {
    // First call: the headers are in, no body byte is read yet. Refuse here
    // what must not go further.
    if (Tracked* t = tracked_of(c)) t->deadline_ns.store(kNoDeadline, std::memory_order_relaxed);
    if (!o.token.empty()) {
      if (const int refused = check_bearer(c, o.token); refused != 0) {
        HttpResponse r =
            plain(refused, refused == 401 ? "this server needs Authorization: Bearer <token>\n"
                                          : "wrong bearer token\n");
        if (refused == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer realm=\"mstar-kv\"");
        return respond(c, r);
      }
    }
    if (const char* cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
      char* end = nullptr;
      errno = 0;
      const unsigned long long n = std::strtoull(cl, &end, 10);
      if (errno != 0 || end == cl || *end != '\0') {
        return respond(c, plain(400, "Content-Length '" + std::string(cl) + "' is not a number\n"));
      }
      if (n > o.max_body_bytes) {
        return respond(c, plain(413, "request body of " + std::to_string(n) + " bytes, limit " +
                                         std::to_string(o.max_body_bytes) + "\n"));
      }
    }
    *con_cls = new RequestState;
    return MHD_YES;
  }
  auto* st = static_cast<RequestState*>(*con_cls);
  if (*upload_data_size != 0) {  // a chunk of a chunked body (Content-Length was checked)
    st->body_bytes += *upload_data_size;
    *upload_data_size = 0;
    // libmicrohttpd answers only once the body is in: drop an oversized one
    // up to a bound, answer 413 at its end, close the connection past it.
    if (st->body_bytes > o.max_body_bytes + kDiscardBytes) return MHD_NO;
    return MHD_YES;
  }
  if (st->body_bytes > o.max_body_bytes) {
    HttpResponse r = plain(413, "request body of " + std::to_string(st->body_bytes) +
                                    " bytes, limit " + std::to_string(o.max_body_bytes) + "\n");
    r.headers.emplace_back(MHD_HTTP_HEADER_CONNECTION, "close");
    return respond(c, r);
  }
  HttpRequest req;
  req.method = std::strcmp(method, "HEAD") == 0 ? "GET" : method;
  req.path = url;
  HttpResponse r;
  try {
    r = impl->handler(req);
  } catch (const std::exception& e) {
    r = plain(500, std::string("internal error: ") + e.what() + "\n");
  }
  return respond(c, r);
}

void on_completed(void* cls, MHD_Connection* c, void** con_cls,
                  MHD_RequestTerminationCode /*why*/) {
  delete static_cast<RequestState*>(*con_cls);
  *con_cls = nullptr;
  // The next request's headers are due within the header timeout.
  if (Tracked* t = tracked_of(c)) {
    t->deadline_ns.store(static_cast<HttpServer::Impl*>(cls)->header_deadline(),
                         std::memory_order_relaxed);
  }
}

[[noreturn]] void cannot_listen(const HttpServerOptions& o, const std::string& why) {
  throw Error(StatusCode::kUnavailable,
              "cannot listen for HTTP on " + o.host + ":" + std::to_string(o.port) + ": " + why);
}

int listen_socket(const HttpServerOptions& o) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  std::string host = o.host;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    cannot_listen(o, std::string("cannot resolve the host: ") + ::gai_strerror(rc));
  }
  std::string why = "no address";
  int fd = -1;
  auto bind_one = [&](const addrinfo* a, bool reuseport) {
    const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (s < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      return -1;
    }
    const int one = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (reuseport) ::setsockopt(s, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
    if (::bind(s, a->ai_addr, a->ai_addrlen) != 0 || ::listen(s, 4096) != 0) {
      const int e = errno;
      why = std::strerror(e);
      ::close(s);
      errno = e;
      return -1;
    }
    return s;
  };
  // True when a server accepts connections at `a`.
  auto someone_listens = [](const addrinfo* a) {
    const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (s < 0) return false;
    const bool yes = ::connect(s, a->ai_addr, a->ai_addrlen) == 0;
    ::close(s);
    return yes;
  };
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = bind_one(a, false);
    // TIME_WAIT connections of a server that set SO_REUSEPORT but not
    // SO_REUSEADDR (cpp-httplib's did) block a SO_REUSEADDR bind for a
    // minute; with no server listening there, bind as they did. A server
    // that does listen there still makes this fail.
    if (fd < 0 && errno == EADDRINUSE && !someone_listens(a)) fd = bind_one(a, true);
  }
  ::freeaddrinfo(res);
  if (fd < 0) cannot_listen(o, why + " (address in use or not local?)");
  return fd;
}

// Raises the soft RLIMIT_NOFILE to the hard one; returns the soft limit now.
rlim_t raise_nofile() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < rl.rlim_max) {
    rlimit want = rl;
    want.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) rl = want;
  }
  return rl.rlim_cur;
}

}  // namespace

HttpServer::HttpServer(HttpServerOptions options, Handler handler) {
  if (options.threads == 0 || options.threads > 64) {
    throw Error(StatusCode::kInvalidArgument,
                "HTTP threads " + std::to_string(options.threads) + " is not in [1, 64]");
  }
  if (options.max_connections < options.threads) {
    throw Error(StatusCode::kInvalidArgument,
                "HTTP connection limit " + std::to_string(options.max_connections) +
                    " is below the thread count " + std::to_string(options.threads));
  }
  if (options.header_timeout_s == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "HTTP header timeout 0 s: no request could "
                "arrive; give at least 1 s");
  }
  if (options.idle_timeout_s == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "HTTP idle timeout 0 s: connections would never "
                "be closed; give at least 1 s");
  }
  // Keep 256 descriptors for the engine, the cache and the listener.
  const rlim_t nofile = raise_nofile();
  const rlim_t room = nofile > 512 ? nofile - 256 : nofile / 2;
  max_connections_ = static_cast<unsigned>(
      std::min<rlim_t>(options.max_connections, std::max<rlim_t>(room, options.threads)));

  impl_ = new Impl;
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
  const HttpServerOptions& o = impl_->options;
  try {
    impl_->listen_fd = listen_socket(o);
  } catch (...) {
    delete impl_;
    impl_ = nullptr;
    throw;
  }
  // The per-connection memory pool holds the request line and headers and
  // the response's headers; the body is copied outside it.
  const std::size_t pool_bytes = o.max_header_bytes + 4096;
  impl_->daemon = MHD_start_daemon(
      MHD_USE_EPOLL_INTERNAL_THREAD, 0, nullptr, nullptr, &on_request, impl_,
      MHD_OPTION_LISTEN_SOCKET, impl_->listen_fd, MHD_OPTION_THREAD_POOL_SIZE,
      static_cast<unsigned>(o.threads), MHD_OPTION_CONNECTION_LIMIT, max_connections_,
      MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned>(o.idle_timeout_s),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, pool_bytes, MHD_OPTION_NOTIFY_COMPLETED, &on_completed,
      impl_, MHD_OPTION_NOTIFY_CONNECTION, &on_connection, impl_, MHD_OPTION_STRICT_FOR_CLIENT, 1,
      MHD_OPTION_END);
  if (impl_->daemon == nullptr) {
    ::close(impl_->listen_fd);
    const HttpServerOptions copy = impl_->options;
    delete impl_;
    impl_ = nullptr;
    cannot_listen(copy, "libmicrohttpd could not start its threads");
  }
  impl_->reaper = std::thread([impl = impl_] { impl->reap(); });
}

HttpServer::~HttpServer() {
  if (impl_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  impl_->reaper.join();
  MHD_stop_daemon(impl_->daemon);  // closes the listening socket too
  delete impl_;
}

}  // namespace mstar::kv::cli
