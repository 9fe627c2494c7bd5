// Copyright mstar-kv authors.
//
// CudaIpcKVTransferInfo: encode / decode / validation of untrusted bytes.
// None of these needs a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "core/codec.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv {
namespace {

using testing::small_layout;

CudaIpcKVTransferInfo sample(const KVLayout& l = small_layout()) {
  CudaIpcKVTransferInfo i;
  for (std::size_t b = 0; b < i.cuda_share.handle.size(); ++b) {
    i.cuda_share.handle[b] = static_cast<std::uint8_t>(b * 7 + 1);
  }
  i.cuda_share.device = 3;
  for (std::size_t b = 0; b < 16; ++b)
    i.cuda_share.device_uuid[b] = static_cast<std::uint8_t>(0xA0 + b);
  i.offset = 2048;  // 4 KiB into the allocation
  i.cuda_share.allocation_bytes = l.total_bytes() + 4096;
  i.size = CudaIpcKVTransferInfo::view_size(l);
  i.stride = CudaIpcKVTransferInfo::view_stride(l);
  i.dtype = "bf16";
  i.requires_grad = false;
  i.layout = l;
  i.generation = 0x0123456789abcdefULL;
  i.owner_pid = 4242;
  return i;
}

// The payload format, field by field, so that each field can be made wrong
// on its own (encode() refuses to write invalid infos).
struct Raw {
  std::uint16_t version = 3;
  std::vector<std::uint8_t> handle = std::vector<std::uint8_t>(64, 9);
  std::uint32_t device = 0;
  std::vector<std::uint8_t> uuid = std::vector<std::uint8_t>(16, 1);
  std::uint64_t allocation_bytes = 0;
  std::vector<std::int64_t> size;
  std::vector<std::int64_t> stride;
  std::uint64_t offset = 0;
  std::string dtype = "bf16";
  std::uint8_t requires_grad = 0;
  KVLayout layout = small_layout();
  std::uint64_t generation = 77;
  std::uint32_t owner_pid = 99;
  std::uint8_t has_epoch_table = 0;
  std::vector<std::uint8_t> epoch_handle = std::vector<std::uint8_t>(64, 5);
  std::uint32_t epoch_pages = 0;
  std::uint8_t has_host_tables = 0;
  std::uint32_t host_tables_fd = 0;
  std::uint32_t host_tables_uid = 0;
  std::vector<std::uint8_t> trailing;

  Raw() {
    allocation_bytes = layout.total_bytes();
    size = CudaIpcKVTransferInfo::view_size(layout);
    stride = CudaIpcKVTransferInfo::view_stride(layout);
  }

  KVTransferInfo encode() const {
    codec::ByteWriter w;
    w.u16(version);
    w.bytes(handle);
    w.u32(device);
    w.bytes(uuid);
    w.u64(allocation_bytes);
    w.u32(static_cast<std::uint32_t>(size.size()));
    for (auto d : size) w.u64(static_cast<std::uint64_t>(d));
    w.u32(static_cast<std::uint32_t>(stride.size()));
    for (auto d : stride) w.u64(static_cast<std::uint64_t>(d));
    w.u64(offset);
    w.str(dtype);
    w.u8(requires_grad);
    w.layout(layout);
    w.u64(generation);
    w.u32(owner_pid);
    w.u8(has_epoch_table);
    if (has_epoch_table) {
      w.bytes(epoch_handle);
      w.u32(epoch_pages);
    }
    w.u8(has_host_tables);
    if (has_host_tables) {
      w.u32(host_tables_fd);
      w.u32(host_tables_uid);
    }
    for (auto b : trailing) w.u8(b);
    return {"cuda_ipc", w.take()};
  }
};

void expect_corrupt(const KVTransferInfo& info, const std::string& needle) {
  testing::expect_error([&] { CudaIpcKVTransferInfo::decode(info); },
                        StatusCode::kCorruptDescriptor, {needle});
}

TEST(CudaIpcInfo, RoundTripsEveryLayoutOrder) {
  for (auto co : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage}) {
    for (auto po : {PageOrder::kNHD, PageOrder::kHND}) {
      for (bool has_v : {true, false}) {
        KVLayout l = small_layout(co, po);
        l.has_v = has_v;
        const auto info = sample(l);
        const KVTransferInfo t = info.encode();
        EXPECT_EQ(t.engine, "cuda_ipc");
        EXPECT_EQ(CudaIpcKVTransferInfo::decode(t), info) << l.to_string();
        // And through the generic frame that SequenceInfo carries.
        EXPECT_EQ(CudaIpcKVTransferInfo::decode(KVTransferInfo::decode(t.encode())), info);
      }
    }
  }
}

TEST(CudaIpcInfo, ViewIsTheLayoutsContiguousTensor) {
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD);
  EXPECT_EQ(CudaIpcKVTransferInfo::view_size(l), (std::vector<std::int64_t>{4, 2, 64, 16, 2, 64}));
  EXPECT_EQ(CudaIpcKVTransferInfo::view_stride(l),
            (std::vector<std::int64_t>{2 * 64 * 16 * 2 * 64, 64 * 16 * 2 * 64, 16 * 2 * 64, 2 * 64,
                                       64, 1}));
  KVLayout p = small_layout(CacheOrder::kPageMajor, PageOrder::kHND);
  p.has_v = false;
  EXPECT_EQ(CudaIpcKVTransferInfo::view_size(p), (std::vector<std::int64_t>{64, 4, 1, 2, 16, 64}));
  // The element at view index (layer, kv, page, token, head, 0) is the byte
  // the layout puts there.
  const auto st = CudaIpcKVTransferInfo::view_stride(l);
  const std::int64_t idx = 3 * st[0] + 1 * st[1] + 17 * st[2] + 5 * st[3] + 1 * st[4];
  EXPECT_EQ(static_cast<std::uint64_t>(idx) * l.element_size(),
            l.block_offset(3, KV::kValue, 17) + l.in_block_offset(5, 1));
  // layer_page: upstream mstar's [L, P, 2, T, H, D].
  const KVLayout lp = small_layout(CacheOrder::kLayerPage, PageOrder::kNHD);
  EXPECT_EQ(CudaIpcKVTransferInfo::view_size(lp), (std::vector<std::int64_t>{4, 64, 2, 16, 2, 64}));
  const auto sp = CudaIpcKVTransferInfo::view_stride(lp);
  const std::int64_t ip = 3 * sp[0] + 17 * sp[1] + 1 * sp[2] + 5 * sp[3] + 1 * sp[4];
  EXPECT_EQ(static_cast<std::uint64_t>(ip) * lp.element_size(),
            lp.block_offset(3, KV::kValue, 17) + lp.in_block_offset(5, 1));
}

TEST(CudaIpcInfo, AcceptsPyTorchDtypeNames) {
  auto info = sample();
  info.dtype = "torch.bfloat16";
  EXPECT_EQ(CudaIpcKVTransferInfo::decode(info.encode()).dtype, "torch.bfloat16");
}

TEST(CudaIpcInfo, EveryTruncationIsRejected) {
  const KVTransferInfo good = sample().encode();
  for (std::size_t n = 0; n < good.payload.size(); ++n) {
    KVTransferInfo bad = good;
    bad.payload.resize(n);
    try {
      CudaIpcKVTransferInfo::decode(bad);
      ADD_FAILURE() << "truncated to " << n << " bytes was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kCorruptDescriptor) << n << ": " << e.what();
    }
  }
}

TEST(CudaIpcInfo, TrailingBytesAndOtherVersionsAreRejected) {
  Raw r;
  EXPECT_NO_THROW(CudaIpcKVTransferInfo::decode(r.encode()));
  r.trailing = {0};
  expect_corrupt(r.encode(), "trailing");
  for (std::uint16_t version : {1, 2, 4}) {
    Raw v;
    v.version = version;
    expect_corrupt(v.encode(), "unsupported version " + std::to_string(version));
  }
}

// The page epoch table (cuda_ipc.hpp "Page epochs"): round trip, and every
// inconsistent form refused naming the field.
TEST(CudaIpcInfo, EpochTableRoundTripsAndBadFormsAreRejected) {
  auto info = sample(small_layout());
  info.has_epoch_table = true;
  info.epoch_handle.fill(0x3c);
  info.epoch_pages = info.layout.num_pages;
  EXPECT_EQ(CudaIpcKVTransferInfo::decode(info.encode()), info);
  {
    Raw r;
    r.has_epoch_table = 1;
    r.epoch_pages = r.layout.num_pages;
    const auto d = CudaIpcKVTransferInfo::decode(r.encode());
    EXPECT_TRUE(d.has_epoch_table);
    EXPECT_EQ(d.epoch_pages, r.layout.num_pages);
    EXPECT_EQ(d.epoch_handle[0], 5);
  }
  {
    Raw r;
    r.has_epoch_table = 1;
    r.epoch_pages = r.layout.num_pages + 1;
    expect_corrupt(r.encode(), "epoch_pages");
  }
  {
    Raw r;
    r.has_epoch_table = 1;
    r.epoch_pages = 0;
    expect_corrupt(r.encode(), "epoch_pages");
  }
  for (std::size_t n : {0u, 63u, 65u}) {
    Raw r;
    r.has_epoch_table = 1;
    r.epoch_pages = r.layout.num_pages;
    r.epoch_handle.assign(n, 1);
    expect_corrupt(r.encode(), "epoch_handle");
  }
  {
    Raw r;
    r.has_epoch_table = 2;  // not a boolean
    expect_corrupt(r.encode(), "has_epoch_table");
  }
  auto stray = sample(small_layout());
  stray.epoch_pages = 7;  // without a table
  EXPECT_THROW(stray.encode(), Error);
}

// The host tables (cuda_ipc.hpp "Layer readiness"): round trip, and every
// inconsistent form refused naming the field.
TEST(CudaIpcInfo, HostTablesRoundTripAndBadFormsAreRejected) {
  auto info = sample(small_layout());
  info.has_epoch_table = true;
  info.epoch_pages = info.layout.num_pages;
  info.has_host_tables = true;
  info.host_tables_fd = 17;
  info.host_tables_uid = 1000;
  EXPECT_EQ(CudaIpcKVTransferInfo::decode(info.encode()), info);
  auto with_tables = [] {
    Raw r;
    r.has_epoch_table = 1;
    r.epoch_pages = r.layout.num_pages;
    r.has_host_tables = 1;
    r.host_tables_fd = 5;
    r.host_tables_uid = 0;
    return r;
  };
  {
    const auto d = CudaIpcKVTransferInfo::decode(with_tables().encode());
    EXPECT_TRUE(d.has_host_tables);
    EXPECT_EQ(d.host_tables_fd, 5u);
  }
  {
    Raw r = with_tables();
    r.has_epoch_table = 0;  // tables without the device epoch table
    expect_corrupt(r.encode(), "has_host_tables");
  }
  {
    Raw r = with_tables();
    r.host_tables_fd = 0x80000000u;
    expect_corrupt(r.encode(), "host_tables_fd");
  }
  {
    Raw r = with_tables();
    r.has_host_tables = 3;  // not a boolean
    expect_corrupt(r.encode(), "has_host_tables");
  }
  {
    Raw r = with_tables();
    r.trailing = {1, 2, 3};  // a truncated or padded field
    expect_corrupt(r.encode(), "trailing");
  }
  auto stray = sample(small_layout());
  stray.host_tables_fd = 3;  // without tables
  EXPECT_THROW(stray.encode(), Error);
}

TEST(CudaIpcInfo, BadHandleLengthIsRejected) {
  for (std::size_t n : {0u, 63u, 65u, 128u}) {
    Raw r;
    r.handle.assign(n, 1);
    expect_corrupt(r.encode(), "cuda_share.handle");
  }
  Raw huge;
  huge.handle.assign(4096, 1);
  expect_corrupt(huge.encode(), "exceeds limit");
  Raw uuid;
  uuid.uuid.assign(15, 1);
  expect_corrupt(uuid.encode(), "cuda_share.device_uuid");
}

TEST(CudaIpcInfo, SizesThatDisagreeWithTheLayoutAreRejected) {
  {
    Raw r;
    r.size[2] = 65;  // one page more than the layout holds
    expect_corrupt(r.encode(), "'size'");
  }
  {
    Raw r;
    r.size.pop_back();
    r.stride.pop_back();
    expect_corrupt(r.encode(), "5 dimensions, expected 6");
  }
  {
    Raw r;
    r.stride[5] = 2;  // not contiguous
    expect_corrupt(r.encode(), "'stride'");
  }
  {
    Raw r;
    std::swap(r.size[3], r.size[4]);  // HND view for an NHD layout
    expect_corrupt(r.encode(), "'size'");
  }
  {
    Raw r;
    r.size[0] = -1;
    expect_corrupt(r.encode(), "size");
  }
}

TEST(CudaIpcInfo, ViewOutsideTheAllocationIsRejected) {
  {
    Raw r;
    r.offset = 1;  // one element past: the view's end leaves the allocation
    expect_corrupt(r.encode(), "outside the allocation");
  }
  {
    Raw r;
    r.allocation_bytes = r.layout.total_bytes() - 1;
    expect_corrupt(r.encode(), "outside the allocation");
  }
  {
    Raw r;
    r.allocation_bytes = r.layout.total_bytes() + 4096;
    r.offset = (1ull << 62);  // offset * element size would overflow 64 bits
    expect_corrupt(r.encode(), "outside the allocation");
  }
  {
    Raw r;
    r.allocation_bytes = ~0ull;
    r.offset = ~0ull / 2;
    expect_corrupt(r.encode(), "out of range");
  }
  {
    Raw r;
    r.allocation_bytes = 0;
    expect_corrupt(r.encode(), "allocation_bytes");
  }
  // The largest offset that fits is accepted.
  Raw ok;
  ok.allocation_bytes = ok.layout.total_bytes() + 4096;
  ok.offset = 2048;
  EXPECT_NO_THROW(CudaIpcKVTransferInfo::decode(ok.encode()));
}

TEST(CudaIpcInfo, RequiresGradIsRejected) {
  Raw r;
  r.requires_grad = 1;
  expect_corrupt(r.encode(), "requires_grad");
  r.requires_grad = 2;
  expect_corrupt(r.encode(), "not 0 or 1");
}

TEST(CudaIpcInfo, DtypeMismatchIsRejected) {
  for (const char* d : {"fp16", "torch.float16", "", "bfloat16"}) {
    Raw r;
    r.dtype = d;
    expect_corrupt(r.encode(), "dtype");
  }
  Raw fp8;
  fp8.layout.dtype = DType::kFloat8E4M3;
  fp8.allocation_bytes = fp8.layout.total_bytes();
  fp8.dtype = "torch.float8_e4m3fn";
  EXPECT_NO_THROW(CudaIpcKVTransferInfo::decode(fp8.encode()));
}

TEST(CudaIpcInfo, ZeroGenerationPidAndWildDevicesAreRejected) {
  {
    Raw r;
    r.generation = 0;
    expect_corrupt(r.encode(), "generation");
  }
  {
    Raw r;
    r.owner_pid = 0;
    expect_corrupt(r.encode(), "owner_pid");
  }
  {
    Raw r;
    r.device = 0x80000000u;
    expect_corrupt(r.encode(), "cuda_share.device");
  }
  {
    Raw r;
    r.layout.num_layers = 0;
    expect_corrupt(r.encode(), "layout");
  }
}

TEST(CudaIpcInfo, OtherEnginesDescriptorsAreInvalidArguments) {
  KVTransferInfo t = sample().encode();
  t.engine = "shm";
  testing::expect_error([&] { CudaIpcKVTransferInfo::decode(t); }, StatusCode::kInvalidArgument);
  EXPECT_THROW(CudaIpcKVTransferInfo::decode(KVTransferInfo{}), Error);
}

TEST(CudaIpcInfo, EncodeRefusesInvalidInfos) {
  auto info = sample();
  info.requires_grad = true;
  testing::expect_error([&] { info.encode(); }, StatusCode::kInvalidArgument);
}

// Runs anywhere: what this build does with device memory when no GPU is
// visible, and that the engine refuses host caches before touching CUDA.
TEST(CudaIpcInfo, EngineRefusesHostCaches) {
  auto host = make_kv_cache(small_layout(), MemoryKind::kHost);
  testing::expect_error(
      [&] {
        KVTransferManager m(TransferEngineInfo{"d", "", "cuda_ipc", {}}, host);
      },
      StatusCode::kInvalidArgument, {"device cache"});
}

TEST(CudaIpcInfo, DeviceCacheWithoutAGpuIsUnavailableWithTheCudaError) {
  const std::string why = cuda_unavailable_reason();
  if (why.empty()) GTEST_SKIP() << "a CUDA device is visible; this case is for hosts without one";
  std::cout << "[ INFO     ] no CUDA device here: " << why << std::endl;
  testing::expect_error([&] { make_kv_cache(small_layout(), MemoryKind::kDevice); },
                        StatusCode::kUnavailable, {"cudaError"});
}

}  // namespace
}  // namespace mstar::kv
