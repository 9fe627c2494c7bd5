// Copyright mstar-kv authors.
#include "bench_proc.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "mstar/kv/status.hpp"

extern char** environ;

namespace mstar::kv::cli::bench {

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void unavailable(const std::string& msg) {
  throw Error(StatusCode::kUnavailable, msg);
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

Child::Child(const SpawnOptions& options) {
  if (options.argv.empty()) unavailable("spawn: empty argv");
  const std::string prog = find_program(options.argv[0]);
  if (prog.empty()) unavailable("program '" + options.argv[0] + "' not found on PATH");

  // Everything the child needs is prepared before fork(): between fork and
  // exec only async-signal-safe calls are allowed (the parent has threads).
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

  int out_fd = -1;
  if (!options.output_file.empty()) {
    out_fd = ::open(options.output_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out_fd < 0) unavailable("cannot open " + options.output_file + ": " + std::strerror(errno));
  }
  int in_pipe[2] = {-1, -1};   // parent writes [1], child reads [0]
  int out_pipe[2] = {-1, -1};  // child writes [1], parent reads [0]
  if (options.pipes) {
    if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0) {
      if (out_fd >= 0) ::close(out_fd);
      unavailable(std::string("pipe: ") + std::strerror(errno));
    }
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    if (out_fd >= 0) ::close(out_fd);
    unavailable(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    if (out_fd >= 0) {
      ::dup2(out_fd, 1);
      ::dup2(out_fd, 2);
    }
    if (options.pipes) {
      // Move both ends above the target numbers first (a pipe end may already
      // sit on a target fd, where dup2 would be a no-op that keeps
      // FD_CLOEXEC); dup2 onto the targets then clears FD_CLOEXEC.
      const int a = ::fcntl(in_pipe[0], F_DUPFD, 64);
      const int b = ::fcntl(out_pipe[1], F_DUPFD, 64);
      ::dup2(a, options.child_in_fd);
      ::dup2(b, options.child_out_fd);
      ::close(a);
      ::close(b);
    }
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::execve(prog.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  pid_ = pid;
  ::setpgid(pid, pid);  // also from here, so that signal() works at once
  if (out_fd >= 0) ::close(out_fd);
  if (options.pipes) {
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    to_child_ = in_pipe[1];
    from_child_ = out_pipe[0];
  }
}

Child::~Child() {
  kill_and_reap();
  if (to_child_ >= 0) ::close(to_child_);
  if (from_child_ >= 0) ::close(from_child_);
}

void Child::close_to_child() {
  if (to_child_ >= 0) ::close(to_child_);
  to_child_ = -1;
}

std::optional<int> Child::wait_for(std::chrono::milliseconds timeout) {
  if (exited_) return status_;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      // Helpers the child started in its group die with it.
      ::kill(-pid_, SIGKILL);
      return status_;
    }
    if (r < 0 && errno != EINTR) {
      exited_ = true;
      status_ = 127;
      return status_;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void Child::signal(int sig) {
  if (!exited_ && pid_ > 0) ::kill(-pid_, sig);
}

void Child::kill_and_reap(std::chrono::milliseconds grace) {
  if (pid_ <= 0 || exited_) return;
  signal(SIGTERM);
  if (!wait_for(grace)) {
    signal(SIGKILL);
    wait_for(std::chrono::milliseconds(5000));
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string temp_file(const std::string& stem) {
  const char* dir = std::getenv("TMPDIR");
  std::string tmpl = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") +
                     "/mstar-kv-bench-" + stem + ".XXXXXX";
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0) unavailable("mkstemp " + tmpl + ": " + std::strerror(errno));
  ::close(fd);
  return tmpl;
}

std::string last_lines(const std::string& text, int n) {
  std::vector<std::string> lines;
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    if (!line.empty()) lines.push_back(line);
  }
  std::string out;
  for (std::size_t i = lines.size() > static_cast<std::size_t>(n) ? lines.size() - n : 0;
       i < lines.size(); ++i) {
    out += (out.empty() ? "" : " | ") + lines[i];
  }
  return out.size() > 400 ? out.substr(out.size() - 400) : out;
}

bool tcp_port_listening(int port) {
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string slot, local, remote, state;
      ls >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (colon == std::string::npos) continue;
      const long p = std::strtol(local.c_str() + colon + 1, nullptr, 16);
      if (p == port && state == "0A") return true;  // 0A = LISTEN
    }
  }
  return false;
}

int pick_port() {
  std::random_device rd;
  std::mt19937 gen(rd());
  std::uniform_int_distribution<int> dist(20000, 29999);
  for (int i = 0; i < 100; ++i) {
    const int p = dist(gen);
    if (!tcp_port_listening(p)) return p;
  }
  return dist(gen);
}

bool write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_exact(int fd, void* data, std::size_t n, std::chrono::milliseconds timeout) {
  auto* p = static_cast<char*>(data);
  const auto deadline = Clock::now() + timeout;
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    const int pr = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return false;
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

}  // namespace mstar::kv::cli::bench
