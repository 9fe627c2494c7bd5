// Copyright mstar-kv authors.
//
// A real child process for multi-process tests (fork/exec), spoken to in
// lines over pipes, killed with the test (PR_SET_PDEATHSIG) and killed and
// reaped by its destructor.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace mstar::kv::testing {

class Child {
 public:
  // Starts argv[0] with argv and `env` added to the environment; stdin and
  // stdout are pipes to this process, and so is stderr when merge_stderr
  // (else it stays the test's stderr).
  explicit Child(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& env = {},
                 bool merge_stderr = true);
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
  int out_ = -1;  // its stdout (and stderr when merged)
  std::string buf_;
};

}  // namespace mstar::kv::testing
