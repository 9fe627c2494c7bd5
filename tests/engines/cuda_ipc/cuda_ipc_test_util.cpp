// Copyright mstar-kv authors.
#include "cuda_ipc_test_util.hpp"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "mstar/kv/cuda_ipc.hpp"

#ifndef CUDA_IPC_OWNER_PATH
#error "CUDA_IPC_OWNER_PATH must name the owner executable"
#endif

namespace mstar::kv::cuda_test {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err));
  }
}

}  // namespace

std::string no_device_reason() { return cuda_unavailable_reason(); }

bool gpu_required() {
  const char* v = std::getenv("MSTAR_KV_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

std::shared_ptr<KVCache> download(const KVCache& dev) {
  auto host = KVCache::create_host(dev.layout());
  check(cudaMemcpy(host->base(), dev.base(), dev.layout().total_bytes(), cudaMemcpyDeviceToHost),
        "cudaMemcpy D2H");
  return host;
}

void upload(const KVCache& host, const KVCache& dev) {
  check(cudaMemcpy(dev.base(), host.base(), dev.layout().total_bytes(), cudaMemcpyHostToDevice),
        "cudaMemcpy H2D");
}

void fill_device_pattern(const KVCache& dev, std::uint64_t seed,
                         std::span<const std::uint32_t> pages, std::uint64_t start,
                         std::uint64_t end) {
  auto host = download(dev);
  fill_pattern(*host, seed, pages, start, end);
  upload(*host, dev);
}

VerifyResult verify_device_pattern(const KVCache& dev, std::uint64_t seed,
                                   std::span<const std::uint32_t> pages, std::uint64_t start,
                                   std::uint64_t end) {
  return verify_pattern(*download(dev), seed, pages, start, end);
}

void fill_device_bytes(const KVCache& dev, std::uint8_t value) {
  check(cudaMemset(dev.base(), value, dev.layout().total_bytes()), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

OwnerProcess::OwnerProcess(const OwnerSpec& spec, std::chrono::milliseconds timeout) {
  int in_pipe[2];
  int out_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    throw std::runtime_error("pipe failed");
  }
  std::vector<std::string> args = {CUDA_IPC_OWNER_PATH,
                                   "--layout", layout_arg(spec.layout),
                                   "--tokens", std::to_string(spec.tokens),
                                   "--seed", std::to_string(spec.seed),
                                   "--scatter", std::to_string(spec.scatter_seed),
                                   "--wrap-offset", std::to_string(spec.wrap_offset)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    // Only async-signal-safe calls between fork and exec.
    ::dup2(in_pipe[0], 0);
    ::dup2(out_pipe[1], 1);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  to_child_ = in_pipe[1];
  from_child_ = out_pipe[0];
  seq_ = wait_for_sequence(timeout);
}

SequenceInfo OwnerProcess::wait_for_sequence(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto nl = buf_.find('\n');
    if (nl != std::string::npos) {
      const std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      if (line.rfind("SEQ ", 0) == 0) return SequenceInfo::decode(from_hex(line.substr(4)));
      if (line.rfind("ERR ", 0) == 0) {
        kill_now();
        throw std::runtime_error("cuda_ipc_owner failed: " + line.substr(4));
      }
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      kill_now();
      throw std::runtime_error("cuda_ipc_owner did not publish its sequence in time");
    }
    pollfd p{from_child_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(from_child_, chunk, sizeof chunk);
    if (n <= 0) {
      kill_now();
      throw std::runtime_error("cuda_ipc_owner exited before publishing its sequence");
    }
    buf_.append(chunk, static_cast<std::size_t>(n));
  }
}

const SequenceInfo& OwnerProcess::regenerate(std::uint64_t seed) {
  return command("regen " + std::to_string(seed) + "\n");
}

const SequenceInfo& OwnerProcess::add_cache(std::uint64_t seed, const KVLayout& layout) {
  return command("regen " + std::to_string(seed) + " " + layout_arg(layout) + "\n");
}

const SequenceInfo& OwnerProcess::reuse(std::uint64_t seed) {
  return command("reuse " + std::to_string(seed) + "\n");
}

void OwnerProcess::send_reuse(std::uint64_t seed) {
  const std::string cmd = "reuse " + std::to_string(seed) + "\n";
  if (::write(to_child_, cmd.data(), cmd.size()) != static_cast<ssize_t>(cmd.size())) {
    throw std::runtime_error("cannot talk to cuda_ipc_owner");
  }
}

const SequenceInfo& OwnerProcess::await_sequence() {
  seq_ = wait_for_sequence(std::chrono::seconds(60));
  return seq_;
}

const SequenceInfo& OwnerProcess::command(const std::string& cmd) {
  if (::write(to_child_, cmd.data(), cmd.size()) != static_cast<ssize_t>(cmd.size())) {
    throw std::runtime_error("cannot talk to cuda_ipc_owner");
  }
  seq_ = wait_for_sequence(std::chrono::seconds(60));
  return seq_;
}

void OwnerProcess::kill_now() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
}

OwnerProcess::~OwnerProcess() {
  kill_now();
  if (to_child_ >= 0) ::close(to_child_);
  if (from_child_ >= 0) ::close(from_child_);
}

}  // namespace mstar::kv::cuda_test
