// Copyright mstar-kv authors.
#include "toolkit/child.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>

#include "mstar/kv/util/status.hpp"

extern char** environ;

namespace mstar::kv::toolkit {

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void unavailable(const std::string& msg) {
  throw Error(StatusCode::kUnavailable, msg);
}

int left_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<long long>(0, left.count()));
}

ChildOptions line_options(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env, bool merge_stderr) {
  ChildOptions o;
  o.argv = argv;
  o.env = env;
  o.in_fd = 0;
  o.out_fd = 1;
  o.merge_stderr = merge_stderr;
  return o;
}

}  // namespace

std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return ::access(name.c_str(), X_OK) == 0 ? name : std::string();
  }
  const char* path = std::getenv("PATH");
  std::stringstream ss(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const std::string full = dir + "/" + name;
    struct stat st {};
    if (::stat(full.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(full.c_str(), X_OK) == 0) {
      return full;
    }
  }
  return {};
}

std::string self_exe() {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) {
    throw Error(StatusCode::kInternal,
                std::string("readlink /proc/self/exe: ") + std::strerror(errno));
  }
  return std::string(exe, static_cast<std::size_t>(n));
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "stopped (status " + std::to_string(status) + ")";
}

Child::Child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
             bool merge_stderr)
    : Child(line_options(argv, env, merge_stderr)) {}

Child::Child(const ChildOptions& options)
    : own_group_(options.own_group),
      drain_output_(options.out_fd == 1),
      destroy_grace_(options.destroy_grace) {
  if (options.argv.empty()) unavailable("spawn: empty argv");
  const std::string prog = find_program(options.argv[0]);
  if (prog.empty()) unavailable("program '" + options.argv[0] + "' not found or not executable");

  // Everything the child needs is prepared before fork().
  std::vector<std::string> args = options.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::map<std::string, std::string> env_map;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env_map[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& k : options.unset_env) env_map.erase(k);
  for (const auto& [k, v] : options.env) env_map[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env_map) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);

  int file_fd = -1;
  if (!options.output_file.empty()) {
    file_fd = ::open(options.output_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (file_fd < 0) {
      unavailable("cannot open " + options.output_file + ": " + std::strerror(errno));
    }
  }
  int in_pipe[2] = {-1, -1};   // we write [1], the child reads [0]
  int out_pipe[2] = {-1, -1};  // the child writes [1], we read [0]
  auto close_all = [&] {
    for (int fd : {file_fd, in_pipe[0], in_pipe[1], out_pipe[0], out_pipe[1]}) {
      if (fd >= 0) ::close(fd);
    }
  };
  if ((options.in_fd >= 0 && ::pipe2(in_pipe, O_CLOEXEC) != 0) ||
      (options.out_fd >= 0 && ::pipe2(out_pipe, O_CLOEXEC) != 0)) {
    const std::string why = std::strerror(errno);
    close_all();
    unavailable("pipe: " + why);
  }
  // The child's fd -> our fd, applied in two steps in the child (first above
  // every target, then onto the targets): a source may sit on a target
  // number, and dup2 onto itself would keep FD_CLOEXEC.
  std::vector<std::pair<int, int>> moves;
  if (options.in_fd >= 0) moves.emplace_back(options.in_fd, in_pipe[0]);
  if (options.out_fd >= 0) {
    moves.emplace_back(options.out_fd, out_pipe[1]);
    if (options.out_fd == 1 && options.merge_stderr) moves.emplace_back(2, out_pipe[1]);
  }
  if (file_fd >= 0) {
    moves.emplace_back(1, file_fd);
    moves.emplace_back(2, file_fd);
  }
  for (const auto& [target, ours] : options.pass_fds) moves.emplace_back(target, ours);
  const bool stdin_given = options.in_fd == 0 || options.pass_fds.count(0) != 0;
  std::vector<int> staged(moves.size(), -1);

  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const std::string why = std::strerror(errno);
    close_all();
    unavailable("fork: " + why);
  }
  if (pid == 0) {
    if (options.own_group) ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    for (std::size_t i = 0; i < moves.size(); ++i) {
      staged[i] = ::fcntl(moves[i].second, F_DUPFD, 256);
      if (staged[i] < 0) ::_exit(127);
    }
    for (std::size_t i = 0; i < moves.size(); ++i) {
      if (::dup2(staged[i], moves[i].first) < 0) ::_exit(127);
    }
    for (int fd : staged) ::close(fd);
    if (!stdin_given) {
      const int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0 && devnull != 0) {
        ::dup2(devnull, 0);
        ::close(devnull);
      }
    }
    ::execve(prog.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  pid_ = pid;
  if (options.own_group) ::setpgid(pid, pid);  // from here too: signal() works at once
  if (file_fd >= 0) ::close(file_fd);
  if (in_pipe[0] >= 0) ::close(in_pipe[0]);
  if (out_pipe[1] >= 0) ::close(out_pipe[1]);
  to_child_ = in_pipe[1];
  from_child_ = out_pipe[0];
}

Child::~Child() {
  if (destroy_grace_.count() > 0) {
    kill_and_reap(destroy_grace_);
  } else {
    kill_now();
  }
  if (to_child_ >= 0) ::close(to_child_);
  if (from_child_ >= 0) ::close(from_child_);
}

void Child::close_to_child() {
  if (to_child_ >= 0) ::close(to_child_);
  to_child_ = -1;
}

bool Child::read_some(int timeout_ms) {
  if (from_child_ < 0) return false;
  pollfd p{from_child_, POLLIN, 0};
  const int r = ::poll(&p, 1, timeout_ms);
  if (r <= 0) return false;
  char tmp[65536];
  const ssize_t n = ::read(from_child_, tmp, sizeof tmp);
  if (n <= 0) return false;
  buf_.append(tmp, static_cast<std::size_t>(n));
  return true;
}

std::string Child::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (auto nl = buf_.find('\n'); nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return line;
    }
    const int left = left_ms(deadline);
    if (left <= 0) {
      throw Error(StatusCode::kTimeout, "no line from child " + std::to_string(pid_) + " within " +
                                            std::to_string(timeout.count()) + " ms (so far: '" +
                                            buf_ + "')");
    }
    if (from_child_ < 0) throw Error(StatusCode::kInvalidArgument, "no pipe from the child");
    pollfd p{from_child_, POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) continue;
    char tmp[65536];
    const ssize_t n = ::read(from_child_, tmp, sizeof tmp);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(StatusCode::kPeerFailure,
                  "child " + std::to_string(pid_) + " closed its output: '" + buf_ + "'");
    }
    buf_.append(tmp, static_cast<std::size_t>(n));
  }
}

std::optional<std::string> Child::poll_line() {
  for (int i = 0; buf_.find('\n') == std::string::npos && i < 64 && read_some(0); ++i) {
  }
  const auto nl = buf_.find('\n');
  if (nl == std::string::npos) return std::nullopt;
  std::string line = buf_.substr(0, nl);
  buf_.erase(0, nl + 1);
  return line;
}

std::string Child::read_all(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    pollfd p{from_child_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    if (!read_some(0)) break;
  }
  return std::exchange(buf_, std::string());
}

bool Child::wait_for_output(const std::string& needle, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (buf_.find(needle) == std::string::npos) {
    const int left = left_ms(deadline);
    if (left <= 0 || !read_some(left)) return false;
  }
  return true;
}

void Child::write_line(const std::string& line) {
  const std::string s = line + "\n";
  const char* p = s.data();
  std::size_t n = s.size();
  ::signal(SIGPIPE, SIG_IGN);
  while (n > 0) {
    const ssize_t k = ::write(to_child_, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      throw Error(StatusCode::kPeerFailure,
                  "cannot write to child " + std::to_string(pid_) + ": it is gone");
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

void Child::reap(int wait_status) {
  reaped_ = true;
  wait_status_ = wait_status;
  // Helpers the child started in its group die with it.
  if (own_group_) ::kill(-pid_, SIGKILL);
  // Keep what it wrote last (bounded: a grandchild may hold the pipe open).
  for (int i = 0; drain_output_ && i < 64 && read_some(0); ++i) {
  }
}

std::optional<int> Child::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!reaped_ && pid_ > 0) {
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      reap(st);
      break;
    }
    if (r < 0 && errno != EINTR) {
      reap(127 << 8);
      break;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    // Drain its output meanwhile: a child blocked on a full pipe never exits.
    if (!drain_output_ || !read_some(5)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(wait_status_)) return WEXITSTATUS(wait_status_);
  return 128 + WTERMSIG(wait_status_);
}

int Child::wait_exit(std::chrono::milliseconds timeout) {
  if (auto rc = wait_for(timeout)) return *rc;
  kill_now();
  return 128 + WTERMSIG(wait_status_);
}

void Child::signal(int sig) {
  if (reaped_ || pid_ <= 0) return;
  ::kill(own_group_ ? -pid_ : pid_, sig);
}

void Child::kill_now() {
  if (reaped_ || pid_ <= 0) return;
  signal(SIGKILL);
  int st = 0;
  while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
  }
  reap(st);
}

void Child::kill_and_reap(std::chrono::milliseconds grace) {
  if (reaped_ || pid_ <= 0) return;
  signal(SIGTERM);
  if (!wait_for(grace)) kill_now();
}

}  // namespace mstar::kv::toolkit
