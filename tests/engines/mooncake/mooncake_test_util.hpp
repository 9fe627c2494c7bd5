// Copyright mstar-kv authors.
//
// What the Mooncake engine tests and their shared-handle peer have in common:
// whether Mooncake can run here, the test layout, and AppMooncake, the
// application side of a shared handle (Mooncake's engine made with its own C
// API, as an application that already runs Mooncake makes it).
#pragma once

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/engine_cases.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::testing {

inline constexpr std::byte kSentinel{0x5A};
inline constexpr std::uint64_t kSeed = 99;

// 2 layers, `pages` pages of 16 tokens, 2 heads x 64 bf16: 4 KiB blocks.
inline KVLayout mooncake_test_layout(std::uint32_t pages = 256) {
  return make_layout(2, pages, 16, 2, 64);
}

// A host cache filled with kSentinel.
inline std::shared_ptr<KVCache> sentinel_cache(const KVLayout& l) {
  auto c = make_kv_cache(l, MemoryKind::kHost);
  std::memset(c->base(), static_cast<int>(kSentinel), c->size_bytes());
  return c;
}

inline std::uint64_t count_changed(const KVCache& c) {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < c.size_bytes(); ++i) n += c.base()[i] != kSentinel;
  return n;
}

// Bytes outside the destinations of `reads` that no longer hold kSentinel.
inline std::uint64_t written_outside(const KVCache& local, const KVLayout& remote,
                                     const std::vector<KVReadInfo>& reads) {
  return bytes_written_outside(local, remote, reads, kSentinel);
}

// Mooncake's engine as the application creates it: createTransferEngine
// (P2P handshake, loopback) + installTransport("tcp"), through Mooncake's C
// API in `lib`; destroyTransferEngine in the destructor. Throws
// std::runtime_error when any step fails.
class AppMooncake {
 public:
  explicit AppMooncake(const std::string& lib) {
    // The application's choices, made before its engine exists.
    ::setenv("MC_TCP_ENABLE_CONNECTION_POOL", "1", 0);
    ::setenv("MC_LOG_LEVEL", "WARNING", 0);
    dl_ = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (dl_ == nullptr) throw std::runtime_error(std::string("dlopen: ") + ::dlerror());
    create_ = reinterpret_cast<Create>(::dlsym(dl_, "createTransferEngine"));
    install_ = reinterpret_cast<Install>(::dlsym(dl_, "installTransport"));
    ip_port_ = reinterpret_cast<IpPort>(::dlsym(dl_, "getLocalIpAndPort"));
    destroy_ = reinterpret_cast<Destroy>(::dlsym(dl_, "destroyTransferEngine"));
    if (!create_ || !install_ || !ip_port_ || !destroy_) {
      ::dlclose(dl_);
      throw std::runtime_error(lib + " lacks part of Mooncake's C API");
    }
    engine_ = create_("P2PHANDSHAKE", "127.0.0.1", "127.0.0.1", 0, 0);
    if (engine_ == nullptr || install_(engine_, "tcp", nullptr) == nullptr) {
      if (engine_ != nullptr) destroy_(engine_);
      ::dlclose(dl_);
      throw std::runtime_error("the application could not start Mooncake's engine");
    }
  }
  ~AppMooncake() {
    destroy_(engine_);
    ::dlclose(dl_);
  }
  AppMooncake(const AppMooncake&) = delete;
  AppMooncake& operator=(const AppMooncake&) = delete;

  MooncakeEngineHandle handle() const noexcept { return engine_; }
  std::string ip_port() const {
    char buf[256] = {};
    ip_port_(engine_, buf, sizeof buf);
    return buf;
  }

 private:
  using Create = void* (*)(const char*, const char*, const char*, std::uint64_t, int);
  using Install = void* (*)(void*, const char*, void**);
  using IpPort = int (*)(void*, char*, std::size_t);
  using Destroy = void (*)(void*);
  void* dl_ = nullptr;
  void* engine_ = nullptr;
  Create create_ = nullptr;
  Install install_ = nullptr;
  IpPort ip_port_ = nullptr;
  Destroy destroy_ = nullptr;
};

}  // namespace mstar::kv::testing
