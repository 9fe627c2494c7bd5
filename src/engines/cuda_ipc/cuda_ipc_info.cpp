// Copyright mstar-kv authors.
//
// CudaIpcKVTransferInfo encoding and validation. Plain C++: no CUDA call, so
// descriptors are checked (and tested) on hosts without a GPU.
#include <algorithm>
#include <array>
#include <string>
#include <string_view>

#include "core/codec.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/util/enum_names.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

constexpr std::uint16_t kPayloadVersion = 3;  // 2: the page epoch table; 3: host tables
constexpr std::size_t kMaxDtypeName = 32;
constexpr std::int32_t kMaxDevice = 1024;
constexpr std::uint32_t kMaxFd = 0x7fffffff;

[[noreturn]] void corrupt(std::string_view field, const std::string& why) {
  throw Error(StatusCode::kCorruptDescriptor,
              "cuda_ipc descriptor field '" + std::string(field) + "': " + why);
}

std::string dims_string(const std::vector<std::int64_t>& v) {
  std::string s = "(";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + ")";
}

// PyTorch's names of the dtypes a layout can hold, indexed by DType.
constexpr std::array<std::string_view, 5> kTorchDTypeNames{
    "torch.float32", "torch.float16", "torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"};
static_assert(kTorchDTypeNames.size() == static_cast<std::size_t>(DType::kFloat8E5M2) + 1);

std::string_view torch_name(DType d) { return enum_name(d, kTorchDTypeNames, ""); }

}  // namespace

std::vector<std::int64_t> CudaIpcKVTransferInfo::view_size(const KVLayout& l) {
  const auto shape = l.view_shape();
  return {shape.begin(), shape.end()};
}

std::vector<std::int64_t> CudaIpcKVTransferInfo::view_stride(const KVLayout& l) {
  const auto size = view_size(l);
  std::vector<std::int64_t> stride(size.size());
  std::int64_t s = 1;
  for (std::size_t i = size.size(); i-- > 0;) {
    stride[i] = s;
    s *= size[i];
  }
  return stride;
}

void CudaIpcKVTransferInfo::validate() const {
  try {
    layout.validate();
  } catch (const Error& e) {
    corrupt("layout", e.status().message());
  }
  if (cuda_share.device < 0 || cuda_share.device >= kMaxDevice) {
    corrupt("cuda_share.device", "device " + std::to_string(cuda_share.device) +
                                     " out of range [0, " + std::to_string(kMaxDevice) + ")");
  }
  if (dtype != kv::to_string(layout.dtype) && dtype != torch_name(layout.dtype)) {
    corrupt("dtype", "'" + dtype + "' does not match the layout's dtype " +
                         std::string(kv::to_string(layout.dtype)));
  }
  if (requires_grad) {
    corrupt("requires_grad", "true; a KV cache never requires grad");
  }
  const auto want_size = view_size(layout);
  const auto want_stride = view_stride(layout);
  if (size != want_size) {
    corrupt("size", dims_string(size) + " is not the layout's view " + dims_string(want_size) +
                        " (" + layout.to_string() + ")");
  }
  if (stride != want_stride) {
    corrupt("stride", dims_string(stride) + " is not the contiguous stride " +
                          dims_string(want_stride) + " of the layout's view");
  }
  // size matches the validated layout, so numel * element_size is
  // layout.total_bytes() (< 2^46) and cannot overflow.
  std::uint64_t numel = 1;
  for (std::int64_t d : size) numel *= static_cast<std::uint64_t>(d);
  const std::uint64_t extent = numel * layout.element_size();
  if (extent != layout.total_bytes()) {
    corrupt("size", "view of " + std::to_string(extent) + " bytes, layout holds " +
                        std::to_string(layout.total_bytes()));
  }
  if (offset < 0) corrupt("offset", std::to_string(offset) + " is negative");
  const auto alloc = cuda_share.allocation_bytes;
  const auto elem = layout.element_size();
  if (alloc == 0) corrupt("cuda_share.allocation_bytes", "0");
  // offset * elem + extent <= alloc, without overflow.
  if (extent > alloc || static_cast<std::uint64_t>(offset) > (alloc - extent) / elem) {
    corrupt("offset", "view [" + std::to_string(offset) + " elements + " + std::to_string(extent) +
                          " bytes) outside the allocation of " + std::to_string(alloc) + " bytes");
  }
  if (generation == 0) corrupt("generation", "0");
  if (owner_pid == 0) corrupt("owner_pid", "0");
  if (has_epoch_table && epoch_pages != layout.num_pages) {
    corrupt("epoch_pages", std::to_string(epoch_pages) + " epoch words for a layout of " +
                               std::to_string(layout.num_pages) + " pages");
  }
  if (!has_epoch_table && (epoch_pages != 0 || std::any_of(epoch_handle.begin(), epoch_handle.end(),
                                                           [](std::uint8_t b) { return b; }))) {
    corrupt("epoch_handle", "set without an epoch table");
  }
  if (has_host_tables && !has_epoch_table) {
    corrupt("has_host_tables", "host tables without an epoch table");
  }
  if (has_host_tables && host_tables_fd > kMaxFd) {
    corrupt("host_tables_fd", "fd " + std::to_string(host_tables_fd) + " out of range [0, " +
                                  std::to_string(kMaxFd) + "]");
  }
  if (!has_host_tables && (host_tables_fd != 0 || host_tables_uid != 0)) {
    corrupt("host_tables_fd", "set without host tables");
  }
}

KVTransferInfo CudaIpcKVTransferInfo::encode() const {
  try {
    validate();
  } catch (const Error& e) {
    throw Error(StatusCode::kInvalidArgument, "cannot encode: " + e.status().message());
  }
  codec::ByteWriter w;
  w.u16(kPayloadVersion);
  w.bytes(cuda_share.handle);
  w.u32(static_cast<std::uint32_t>(cuda_share.device));
  w.bytes(cuda_share.device_uuid);
  w.u64(cuda_share.allocation_bytes);
  w.u32(static_cast<std::uint32_t>(size.size()));
  for (std::int64_t d : size) w.u64(static_cast<std::uint64_t>(d));
  w.u32(static_cast<std::uint32_t>(stride.size()));
  for (std::int64_t d : stride) w.u64(static_cast<std::uint64_t>(d));
  w.u64(static_cast<std::uint64_t>(offset));
  w.str(dtype);
  w.boolean(requires_grad);
  w.layout(layout);
  w.u64(generation);
  w.u32(owner_pid);
  w.boolean(has_epoch_table);
  if (has_epoch_table) {
    w.bytes(epoch_handle);
    w.u32(epoch_pages);
  }
  w.boolean(has_host_tables);
  if (has_host_tables) {
    w.u32(host_tables_fd);
    w.u32(host_tables_uid);
  }
  return KVTransferInfo{kEngineName, w.take()};
}

CudaIpcKVTransferInfo CudaIpcKVTransferInfo::decode(const KVTransferInfo& info) {
  if (info.engine != kEngineName) {
    throw Error(StatusCode::kInvalidArgument,
                "descriptor of engine '" + info.engine + "' given to the cuda_ipc engine");
  }
  if (info.payload.size() > DescriptorLimits::kMaxTransferPayload) {
    corrupt("payload", std::to_string(info.payload.size()) + " bytes exceeds limit " +
                           std::to_string(DescriptorLimits::kMaxTransferPayload));
  }
  codec::ByteReader r(info.payload, "cuda_ipc descriptor");
  const std::uint16_t version = r.u16("version");
  if (version != kPayloadVersion) {
    r.fail("version", "unsupported version " + std::to_string(version) + ", expected " +
                          std::to_string(kPayloadVersion));
  }
  CudaIpcKVTransferInfo out;
  const auto handle = r.bytes("cuda_share.handle", 1024);
  if (handle.size() != CudaIpcShare::kHandleBytes) {
    r.fail("cuda_share.handle", "length " + std::to_string(handle.size()) + ", expected " +
                                    std::to_string(CudaIpcShare::kHandleBytes));
  }
  std::copy(handle.begin(), handle.end(), out.cuda_share.handle.begin());
  const std::uint32_t device = r.u32("cuda_share.device");
  if (device >= static_cast<std::uint32_t>(kMaxDevice)) {
    r.fail("cuda_share.device", "device " + std::to_string(device) + " out of range [0, " +
                                    std::to_string(kMaxDevice) + ")");
  }
  out.cuda_share.device = static_cast<std::int32_t>(device);
  const auto uuid = r.bytes("cuda_share.device_uuid", 1024);
  if (uuid.size() != out.cuda_share.device_uuid.size()) {
    r.fail("cuda_share.device_uuid", "length " + std::to_string(uuid.size()) + ", expected 16");
  }
  std::copy(uuid.begin(), uuid.end(), out.cuda_share.device_uuid.begin());
  out.cuda_share.allocation_bytes = r.u64("cuda_share.allocation_bytes");
  for (auto* dims : {&out.size, &out.stride}) {
    const char* field = dims == &out.size ? "size" : "stride";
    const std::uint32_t n = r.u32(field);
    if (n != kViewDims) {
      r.fail(field, std::to_string(n) + " dimensions, expected " + std::to_string(kViewDims));
    }
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint64_t v = r.u64(field);
      if (v > (1ull << 62)) r.fail(field, "dimension " + std::to_string(v) + " out of range");
      dims->push_back(static_cast<std::int64_t>(v));
    }
  }
  const std::uint64_t offset = r.u64("offset");
  if (offset > (1ull << 62)) r.fail("offset", std::to_string(offset) + " out of range");
  out.offset = static_cast<std::int64_t>(offset);
  out.dtype = r.str("dtype", kMaxDtypeName);
  out.requires_grad = r.boolean("requires_grad");
  out.layout = r.layout("layout");
  out.generation = r.u64("generation");
  out.owner_pid = r.u32("owner_pid");
  out.has_epoch_table = r.boolean("has_epoch_table");
  if (out.has_epoch_table) {
    const auto eh = r.bytes("epoch_handle", 1024);
    if (eh.size() != CudaIpcShare::kHandleBytes) {
      r.fail("epoch_handle", "length " + std::to_string(eh.size()) + ", expected " +
                                 std::to_string(CudaIpcShare::kHandleBytes));
    }
    std::copy(eh.begin(), eh.end(), out.epoch_handle.begin());
    out.epoch_pages = r.u32("epoch_pages");
  }
  out.has_host_tables = r.boolean("has_host_tables");
  if (out.has_host_tables) {
    out.host_tables_fd = r.u32("host_tables_fd");
    out.host_tables_uid = r.u32("host_tables_uid");
  }
  r.expect_end();
  out.validate();
  return out;
}

}  // namespace mstar::kv
