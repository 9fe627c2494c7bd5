// Copyright mstar-kv authors.
//
// Helpers of the shm engine tests: hex, layouts as one argument, and a real
// child process (fork/exec) spoken to in lines over pipes, killed and reaped
// by its destructor.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/wire.hpp"
#include "mstar/kv/layout.hpp"

namespace mstar::kv::shmtest {

using testing::from_hex;
using testing::to_hex;
using testing::layout_arg;
inline KVLayout parse_layout(const std::string& s) { return testing::parse_layout_arg(s); }

class Child {
 public:
  // Starts argv[0] with argv; stdin and stdout are pipes to this process.
  explicit Child(const std::vector<std::string>& argv);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  // The next line of stdout; throws std::runtime_error on timeout or EOF.
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  // Everything on stdout until EOF (or the timeout).
  std::string read_all(std::chrono::milliseconds timeout);
  void write_line(const std::string& line);
  // SIGKILL and reap.
  void kill_now();
  // Waits up to `timeout` for it to exit; returns the wait status, or -1 (and
  // kills it) on timeout.
  int wait(std::chrono::milliseconds timeout);
  bool reaped() const { return pid_ < 0; }

 private:
  pid_t pid_ = -1;
  int in_ = -1;   // its stdin
  int out_ = -1;  // its stdout (and stderr)
  std::string buf_;
};

}  // namespace mstar::kv::shmtest
