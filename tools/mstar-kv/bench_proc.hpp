// Copyright mstar-kv authors.
//
// Child processes for `mstar-kv bench`: the benchmark's server processes
// (the remote side of a same-host or loopback transfer) and the external
// baselines (ucx_perftest, iperf3, Mooncake's transfer_engine_bench).
//
// Every child runs in its own process group, dies with the parent
// (PR_SET_PDEATHSIG) and is bounded in time: Child's destructor kills the
// whole group (SIGTERM, then SIGKILL) and reaps it. Not thread-safe; one
// owner per Child.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mstar::kv::cli::bench {

struct SpawnOptions {
  std::vector<std::string> argv;               // argv[0] is resolved on PATH
  std::map<std::string, std::string> env;      // set on top of the parent's
  std::vector<std::string> unset_env;          // removed from the parent's
  std::string output_file;                     // stdout+stderr go here ("" = inherit)
  // Pipes: when set, the child's fd `child_in_fd` reads what the parent writes
  // to Child::to_child(), and its fd `child_out_fd` writes what the parent
  // reads from Child::from_child().
  bool pipes = false;
  int child_in_fd = 3;
  int child_out_fd = 4;
};

class Child {
 public:
  // Throws Error(kUnavailable) when the program cannot be found or forked.
  explicit Child(const SpawnOptions& options);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const noexcept { return pid_; }
  int to_child() const noexcept { return to_child_; }
  int from_child() const noexcept { return from_child_; }
  void close_to_child();

  // Waits until the child exits or `timeout` passes; the exit status
  // (WEXITSTATUS, or 128+signal) or nullopt on timeout.
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  // Sends `sig` to the child's process group.
  void signal(int sig);
  // SIGTERM, up to `grace` to exit, then SIGKILL; reaps. Idempotent.
  void kill_and_reap(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));
  bool exited() const noexcept { return exited_; }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  bool exited_ = false;
  int status_ = 0;
};

// Resolves a program name on PATH; "" when not found.
std::string find_program(const std::string& name);
// The whole file, or "" when it cannot be read.
std::string read_file(const std::string& path);
// A fresh temporary file name under $TMPDIR (or /tmp); the file exists.
std::string temp_file(const std::string& stem);
// The last `n` non-empty lines of `text` joined by " | ", at most 400 chars.
std::string last_lines(const std::string& text, int n);
// True when some socket listens on TCP `port` (any address), per /proc/net/tcp.
bool tcp_port_listening(int port);
// A random TCP port in [20000, 30000) that nothing listens on (outside the
// kernel's ephemeral range, as the project's rules ask).
int pick_port();

// Blocking I/O on pipes, with a deadline; false on EOF, error or timeout.
bool write_all(int fd, const void* data, std::size_t n);
bool read_exact(int fd, void* data, std::size_t n, std::chrono::milliseconds timeout);

}  // namespace mstar::kv::cli::bench
