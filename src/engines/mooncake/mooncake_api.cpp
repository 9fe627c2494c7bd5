// Copyright mstar-kv authors.
#include "mooncake_api.hpp"

#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstdlib>
#include <utility>

#include "mstar/kv/util/enum_names.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::mooncake {

// The C layouts of transfer_engine_c.h on LP64 (x86_64, aarch64).
static_assert(sizeof(void*) == 8, "the Mooncake C API is used on LP64 only");
static_assert(offsetof(McTransferRequest, opcode) == 0);
static_assert(offsetof(McTransferRequest, source) == 8);
static_assert(offsetof(McTransferRequest, target_id) == 16);
static_assert(offsetof(McTransferRequest, target_offset) == 24);
static_assert(offsetof(McTransferRequest, length) == 32);
static_assert(sizeof(McTransferRequest) == 40);
static_assert(offsetof(McTransferStatus, transferred_bytes) == 8);
static_assert(sizeof(McTransferStatus) == 16);

constexpr std::array<std::string_view, 7> kTaskStatusNames{
    "WAITING", "PENDING", "INVALID", "CANCELED", "COMPLETED", "TIMEOUT", "FAILED"};
static_assert(kTaskStatusNames.size() == static_cast<std::size_t>(McTaskStatus::kFailed) + 1);

const char* task_status_name(int status) noexcept {
  // Every name is a literal, so its data() is NUL-terminated.
  return enum_name(static_cast<McTaskStatus>(status), kTaskStatusNames, "UNKNOWN").data();
}

std::string status_code_name(int code) {
  const char* name = nullptr;
  switch (code) {
    case 0:
      name = "Ok";
      break;
    case 1:
      name = "InvalidArgument";
      break;
    case 2:
      name = "TooManyRequests";
      break;
    case 3:
      name = "AddressNotRegistered";
      break;
    case 4:
      name = "BatchBusy";
      break;
    case 6:
      name = "DeviceNotFound";
      break;
    case 7:
      name = "AddressOverlapped";
      break;
    case 8:
      name = "NotSupportedTransport";
      break;
    case 101:
      name = "Dns";
      break;
    case 102:
      name = "Socket";
      break;
    case 103:
      name = "MalformedJson";
      break;
    case 104:
      name = "RejectHandshake";
      break;
    case 200:
      name = "Metadata";
      break;
    case 201:
      name = "Endpoint";
      break;
    case 202:
      name = "Context";
      break;
    case 300:
      name = "Numa";
      break;
    case 301:
      name = "Clock";
      break;
    case 302:
      name = "Memory";
      break;
    case 999:
      name = "NotImplemented";
      break;
    default:
      break;
  }
  std::string out = name != nullptr ? name : "code";
  out += " (" + std::to_string(code) + ")";
  return out;
}

std::string resolve_library_path(const std::map<std::string, std::string>& options) {
  if (auto it = options.find(kLibOption); it != options.end() && !it->second.empty()) {
    return it->second;
  }
  // getenv is read once here, at engine creation; the engine never writes it.
  if (const char* env = std::getenv(kLibEnv); env != nullptr && *env != '\0') {
    return env;
  }
  return kDefaultLib;
}

namespace {

// Resolves `name` into `fn`; throws naming the symbol when it is absent.
template <typename Fn>
void resolve(void* handle, const std::string& path, const char* name, Fn& fn) {
  dlerror();  // clear a stale error
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    const char* err = dlerror();
    throw Error(StatusCode::kUnavailable,
                "Mooncake library '" + path + "' lacks the C API symbol '" + name + "'" +
                    (err != nullptr ? std::string(": ") + err : std::string()) +
                    "; point --mooncake-lib / MSTAR_KV_MOONCAKE_LIB at a "
                    "libtransfer_engine.so built with transfer_engine_c.h");
  }
  // POSIX guarantees that object and function pointers convert via dlsym.
  fn = reinterpret_cast<Fn>(sym);
}

}  // namespace

MooncakeLibrary::MooncakeLibrary(const std::string& path) : path_(path) {
  dlerror();
  handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) {
    const char* err = dlerror();
    throw Error(StatusCode::kUnavailable, "cannot load Mooncake library '" + path + "': " +
                                              (err != nullptr ? err : "unknown dlopen error") +
                                              "; set --mooncake-lib PATH or " + kLibEnv);
  }
  try {
    // Each C symbol into the member of the same name.
#define MSTAR_KV_RESOLVE(fn) resolve(handle_, path_, #fn, api_.fn)
    MSTAR_KV_RESOLVE(createTransferEngine);
    MSTAR_KV_RESOLVE(getLocalIpAndPort);
    MSTAR_KV_RESOLVE(installTransport);
    MSTAR_KV_RESOLVE(openSegment);
    MSTAR_KV_RESOLVE(closeSegment);
    MSTAR_KV_RESOLVE(destroyTransferEngine);
    MSTAR_KV_RESOLVE(registerLocalMemory);
    MSTAR_KV_RESOLVE(unregisterLocalMemory);
    MSTAR_KV_RESOLVE(allocateBatchID);
    MSTAR_KV_RESOLVE(submitTransfer);
    MSTAR_KV_RESOLVE(getTransferStatus);
    MSTAR_KV_RESOLVE(freeBatchID);
#undef MSTAR_KV_RESOLVE
    dlerror();
    api_.openSegmentNoCache =
        reinterpret_cast<McOpenSegmentFn>(dlsym(handle_, "openSegmentNoCache"));
  } catch (...) {
    dlclose(handle_);
    handle_ = nullptr;
    throw;
  }
}

std::string MooncakeLibrary::other_global_copy() const {
  dlerror();
  void* global = dlsym(RTLD_DEFAULT, "createTransferEngine");
  if (global == nullptr || api_.createTransferEngine == nullptr ||
      global == reinterpret_cast<void*>(api_.createTransferEngine)) {
    return "";
  }
  Dl_info info{};
  if (dladdr(global, &info) != 0 && info.dli_fname != nullptr) return info.dli_fname;
  return "(an unnamed object)";
}

MooncakeLibrary::~MooncakeLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

MooncakeLibrary::MooncakeLibrary(MooncakeLibrary&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      path_(std::move(other.path_)),
      api_(std::exchange(other.api_, MooncakeApi{})) {}

MooncakeLibrary& MooncakeLibrary::operator=(MooncakeLibrary&& other) noexcept {
  if (this != &other) {
    if (handle_ != nullptr) dlclose(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
    path_ = std::move(other.path_);
    api_ = std::exchange(other.api_, MooncakeApi{});
  }
  return *this;
}

}  // namespace mstar::kv::mooncake
