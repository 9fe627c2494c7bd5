// Copyright mstar-kv authors.
//
// Child: the one helper for real child processes, used by the CLI (bench's
// servers and baselines, soak's prefill processes, demo's roles) and by the
// multi-process tests (peers, owners, the CLI under test).
//
// fork + exec with everything prepared before the fork (only
// async-signal-safe calls between fork and exec: callers have threads). The
// child dies with this process (PR_SET_PDEATHSIG), may run in its own process
// group (signals then reach its helpers too), and is killed and reaped by the
// destructor. Not thread-safe: one owner per Child. Errors: Error(kUnavailable)
// when the program cannot be found or started; reads throw Error(kTimeout) or
// Error(kPeerFailure) (Error is a std::runtime_error).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mstar::kv::toolkit {

struct ChildOptions {
  std::vector<std::string> argv;           // argv[0]: a path, or a name looked up on PATH
  std::map<std::string, std::string> env;  // set on top of this process's environment
  std::vector<std::string> unset_env;      // removed from it
  // A pipe from this process (to_child(), write_line) to the child's fd
  // `in_fd` (0: its stdin); -1: none. stdin is /dev/null unless in_fd is 0.
  int in_fd = -1;
  // A pipe from the child's fd `out_fd` (1: its stdout) to this process
  // (from_child(), read_line, wait_for_output); -1: none.
  int out_fd = -1;
  // With out_fd 1: the child's stderr goes into the same pipe.
  bool merge_stderr = false;
  // Non-empty: the child's stdout and stderr go to this file.
  std::string output_file;
  // Descriptors of this process the child gets as its own: {child fd, ours}.
  std::map<int, int> pass_fds;
  // Its own process group: signal() and the kills reach the whole group.
  bool own_group = false;
  // What the destructor allows before SIGKILL: 0 kills at once, else
  // SIGTERM first and this long to exit.
  std::chrono::milliseconds destroy_grace{0};
};

class Child {
 public:
  explicit Child(const ChildOptions& options);
  // The common case: argv with stdin and stdout (and stderr when
  // merge_stderr) on pipes to this process, env added.
  explicit Child(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& env = {}, bool merge_stderr = true);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const noexcept { return pid_; }
  int to_child() const noexcept { return to_child_; }
  int from_child() const noexcept { return from_child_; }
  // Closes our end of the input pipe (the child sees EOF).
  void close_to_child();

  // The next line the child wrote (without '\n').
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  // A whole line it has already written (without waiting), or nullopt.
  std::optional<std::string> poll_line();
  // Everything it writes until EOF or the timeout (and what was buffered).
  std::string read_all(std::chrono::milliseconds timeout);
  // Reads until `needle` is in output() (true), or EOF / the timeout (false).
  bool wait_for_output(const std::string& needle, std::chrono::milliseconds timeout);
  // What wait_for_output and a finished wait have read so far.
  const std::string& output() const noexcept { return buf_; }
  // Writes `line` + '\n'; throws Error(kPeerFailure) when the child is gone.
  void write_line(const std::string& line);

  // Waits up to `timeout` for the child to exit; its exit code (128 + signal
  // when killed), or nullopt while it still runs. With its stdout on our
  // pipe (out_fd 1), what it writes meanwhile and last is kept in output().
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  // The wait status of the exit (waitpid's), once reaped.
  int wait_status() const noexcept { return wait_status_; }
  // Waits up to `timeout`, then SIGKILLs; the exit code (128 + signal).
  int wait_exit(std::chrono::milliseconds timeout);
  bool reaped() const noexcept { return reaped_; }

  // Sends `sig` to the child (its group with own_group).
  void signal(int sig);
  // SIGKILL and reap.
  void kill_now();
  // SIGTERM, up to `grace` to exit, then SIGKILL; reaps. Idempotent.
  void kill_and_reap(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));

 private:
  bool read_some(int timeout_ms);  // false on EOF, error or timeout
  void reap(int wait_status);

  pid_t pid_ = -1;
  bool own_group_ = false;
  bool drain_output_ = false;  // stdout is ours: keep reading it while waiting
  bool reaped_ = false;
  int wait_status_ = 0;
  int to_child_ = -1;
  int from_child_ = -1;
  std::chrono::milliseconds destroy_grace_{0};
  std::string buf_;
};

// Resolves a program name on PATH (a name with '/' is taken as it is); ""
// when not found or not executable.
std::string find_program(const std::string& name);

// This executable's path (/proc/self/exe), to start it again in another
// role. Throws Error(kInternal) when it cannot be read.
std::string self_exe();

// What became of a child, from its wait status: "exited with status 1",
// "was killed by signal 9 (Killed)".
std::string describe_wait_status(int status);

}  // namespace mstar::kv::toolkit
