// Copyright mstar-kv authors.
//
// Mooncake's transfer engine C API, loaded at run time (private header).
//
// mstar-kv has no build-time dependency on Mooncake: the declarations below
// are our own, written from Mooncake's documented C header
// (mooncake-transfer-engine/include/transfer_engine_c.h), and the functions
// are looked up with dlopen/dlsym in a library the user points to. Only the
// calls the engine uses are declared. The struct layouts must match the C
// ABI of that header on LP64; static_asserts in the .cpp pin them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace mstar::kv::mooncake {

// ---- C ABI (names ours; layouts and values from transfer_engine_c.h) ------
extern "C" {

using McEngine = void*;            // transfer_engine_t
using McTransport = void*;         // transport_t
using McSegmentId = std::int32_t;  // segment_id_t (a #define there)
using McBatchId = std::uint64_t;   // batch_id_t

// struct transfer_request
struct McTransferRequest {
  int opcode;                   // kOpcodeRead / kOpcodeWrite
  void* source;                 // local address (the destination of a READ)
  McSegmentId target_id;        // from openSegment
  std::uint64_t target_offset;  // the peer's ABSOLUTE virtual address
  std::uint64_t length;
};

// struct transfer_status
struct McTransferStatus {
  int status;  // McTaskStatus
  std::uint64_t transferred_bytes;
};

using McCreateTransferEngineFn = McEngine (*)(const char* metadata_conn_string,
                                              const char* local_server_name,
                                              const char* ip_or_host_name, std::uint64_t rpc_port,
                                              int auto_discover);
using McGetLocalIpAndPortFn = int (*)(McEngine, char* buf_out, std::size_t buf_len);
using McInstallTransportFn = McTransport (*)(McEngine, const char* proto, void** args);
using McOpenSegmentFn = McSegmentId (*)(McEngine, const char* segment_name);
using McCloseSegmentFn = int (*)(McEngine, McSegmentId);
using McDestroyTransferEngineFn = void (*)(McEngine);
using McRegisterLocalMemoryFn = int (*)(McEngine, void* addr, std::size_t length,
                                        const char* location, int remote_accessible);
using McUnregisterLocalMemoryFn = int (*)(McEngine, void* addr);
using McAllocateBatchIdFn = McBatchId (*)(McEngine, std::size_t batch_size);
using McSubmitTransferFn = int (*)(McEngine, McBatchId, McTransferRequest* entries,
                                   std::size_t count);
using McGetTransferStatusFn = int (*)(McEngine, McBatchId, std::size_t task_id,
                                      McTransferStatus* status);
using McFreeBatchIdFn = int (*)(McEngine, McBatchId);

}  // extern "C"

inline constexpr int kOpcodeRead = 0;
inline constexpr int kOpcodeWrite = 1;
inline constexpr McBatchId kInvalidBatch = UINT64_MAX;

// transfer_status.status values.
enum class McTaskStatus : int {
  kWaiting = 0,
  kPending = 1,
  kInvalid = 2,
  kCanceled = 3,
  kCompleted = 4,
  kTimeout = 5,
  kFailed = 6,
};

// True for the states after which Mooncake no longer touches the task's
// buffers: freeBatchID succeeds only once every task was seen in one of them.
// (TIMEOUT is not final: Mooncake reports it while the request's slices are
// still outstanding in the transport.)
constexpr bool is_final(int status) noexcept {
  return status == static_cast<int>(McTaskStatus::kCompleted) ||
         status == static_cast<int>(McTaskStatus::kFailed);
}
const char* task_status_name(int status) noexcept;
// Mooncake Status::Code returned by submitTransfer / getTransferStatus /
// freeBatchID, e.g. 3 -> "AddressNotRegistered".
std::string status_code_name(int code);

// The function table of one loaded library; every required pointer is
// non-null.
struct MooncakeApi {
  McCreateTransferEngineFn createTransferEngine = nullptr;
  McGetLocalIpAndPortFn getLocalIpAndPort = nullptr;
  McInstallTransportFn installTransport = nullptr;
  McOpenSegmentFn openSegment = nullptr;
  McCloseSegmentFn closeSegment = nullptr;
  McDestroyTransferEngineFn destroyTransferEngine = nullptr;
  McRegisterLocalMemoryFn registerLocalMemory = nullptr;
  McUnregisterLocalMemoryFn unregisterLocalMemory = nullptr;
  McAllocateBatchIdFn allocateBatchID = nullptr;
  McSubmitTransferFn submitTransfer = nullptr;
  McGetTransferStatusFn getTransferStatus = nullptr;
  McFreeBatchIdFn freeBatchID = nullptr;
  // Optional (null when the library lacks it): openSegment after refreshing
  // Mooncake's cached descriptor of that segment.
  McOpenSegmentFn openSegmentNoCache = nullptr;
};

// Where to load Mooncake from: options["mooncake_lib"], else the environment
// variable MSTAR_KV_MOONCAKE_LIB, else "libtransfer_engine.so" (found through
// the dynamic loader's search path).
inline constexpr const char* kLibOption = "mooncake_lib";
inline constexpr const char* kLibEnv = "MSTAR_KV_MOONCAKE_LIB";
inline constexpr const char* kDefaultLib = "libtransfer_engine.so";
std::string resolve_library_path(const std::map<std::string, std::string>& options);

// A dlopen()ed Mooncake transfer-engine library with every symbol resolved.
// Move-only RAII handle: the destructor dlclose()s it, so every Mooncake
// object created through api() must be destroyed first. Immutable after
// construction; api() is safe from any thread.
class MooncakeLibrary {
 public:
  // Loads `path` (RTLD_NOW | RTLD_LOCAL) and resolves every symbol. Throws
  // Error(kUnavailable) naming the path and dlerror() when the library cannot
  // be loaded, or naming the first missing symbol. Nothing is kept open on
  // failure.
  explicit MooncakeLibrary(const std::string& path);
  ~MooncakeLibrary();

  MooncakeLibrary(MooncakeLibrary&& other) noexcept;
  MooncakeLibrary& operator=(MooncakeLibrary&& other) noexcept;
  MooncakeLibrary(const MooncakeLibrary&) = delete;
  MooncakeLibrary& operator=(const MooncakeLibrary&) = delete;

  const MooncakeApi& api() const noexcept { return api_; }
  const std::string& path() const noexcept { return path_; }

  // The file of ANOTHER copy of Mooncake's C API that the process already has
  // in its global symbol scope (e.g. an application linked against a
  // different libtransfer_engine.so), or "" when there is none or it is this
  // one. A handle made by one copy must not be driven by another.
  std::string other_global_copy() const;

 private:
  void* handle_ = nullptr;
  std::string path_;
  MooncakeApi api_;
};

}  // namespace mstar::kv::mooncake
