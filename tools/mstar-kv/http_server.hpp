// Copyright mstar-kv authors.
//
// The HTTP/1.1 server behind `mstar-kv serve`'s control plane: Debian's
// libmicrohttpd (0.9.75) with epoll, a small thread pool and keep-alive.
//
// Why not cpp-httplib's server (measured 2026-12-03, README "serve"): it
// gives every connection a thread of a fixed pool for as long as the
// connection lives, so a few hundred idle connections (300 here) leave no
// thread for a legitimate request (it timed out after 10 s), and 32
// keep-alive clients on its 8 threads gave a p99 of 640 ms. An event loop
// holds idle connections at the cost of a file descriptor and a small
// buffer each, and answers the rest.
//
// What the server enforces before a handler runs:
//   - at most `max_connections` connections (more wait in the kernel's listen
//     backlog, unanswered, until one closes); a connection is closed when a
//     request's line and headers are not all in `header_timeout_s` seconds
//     after it opened or after its previous response (idle or trickling,
//     however slowly bytes come), or after `idle_timeout_s` seconds without a
//     byte at any point (a stalled body, a client that does not read);
//   - a request line and headers that fit `max_header_bytes` (else 414 or
//     431), a body of at most `max_body_bytes` (else 413), well-formed
//     HTTP/1.x (else 400);
//   - with a token: `Authorization: Bearer <token>` on every request (missing
//     or not Bearer: 401 with `WWW-Authenticate: Bearer`; wrong: 403),
//     compared in constant time, before the body is read or a handler runs.
// Responses go out with their headers in one write on a TCP_NODELAY socket
// (no Nagle/delayed-ACK stall on kept-alive connections).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace mstar::kv::cli {

struct HttpRequest {
  std::string method;  // "GET", "POST", ... ("HEAD" is answered as "GET")
  std::string path;    // percent-decoded, without the query
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // an address or a name getaddrinfo resolves
  std::uint16_t port = 0;
  unsigned threads = 2;                  // event loops (each its own epoll)
  unsigned max_connections = 4096;       // lowered to fit RLIMIT_NOFILE
  unsigned header_timeout_s = 10;        // request line + headers due within
  unsigned idle_timeout_s = 10;          // no byte for this long: closed
  std::size_t max_header_bytes = 16384;  // request line + headers
  std::size_t max_body_bytes = 4096;     // request body
  std::string token;                     // empty: no authentication
};

class HttpServer {
 public:
  using Handler = std::function<HttpResponse(const HttpRequest&)>;

  // Binds, listens and starts serving on its own threads; throws Error
  // (kUnavailable naming the address and the reason) when it cannot. The
  // handler runs on any of the server's threads, concurrently.
  HttpServer(HttpServerOptions options, Handler handler);
  ~HttpServer();  // stops: closes every connection, joins the threads
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The limit in force (max_connections, lowered to fit RLIMIT_NOFILE).
  unsigned max_connections() const { return max_connections_; }

  struct Impl;

 private:
  Impl* impl_ = nullptr;
  unsigned max_connections_ = 0;
};

}  // namespace mstar::kv::cli
