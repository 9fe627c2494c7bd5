// Copyright mstar-kv authors.
//
// Writes the seed corpus: valid encodings from the library's own encoders
// (and a few bytes for the planner), one directory per fuzz target.
//   fuzz_make_corpus OUT_DIR
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/layout.hpp"
#if MSTAR_KV_FUZZ_SHM
#include "mstar/kv/engines/shm.hpp"
#endif
#if MSTAR_KV_FUZZ_UCX
#include "mstar/kv/engines/ucx.hpp"
#endif
#if MSTAR_KV_FUZZ_MOONCAKE
#include "mstar/kv/engines/mooncake.hpp"
#endif
#if MSTAR_KV_FUZZ_CUDA_IPC
#include "mstar/kv/engines/cuda_ipc.hpp"
#endif

namespace {

using namespace mstar::kv;
namespace fs = std::filesystem;

void write(const fs::path& dir, const std::string& name, const std::vector<std::uint8_t>& bytes,
           bool frame_prefix) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary);
  // Frame targets read their first byte as a flag (see fuzz_util.hpp); 0
  // means "take the bytes as they are".
  if (frame_prefix) out.put('\0');
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

KVLayout layout(std::uint32_t layers, std::uint32_t pages, bool has_v, CacheOrder co,
                PageOrder po) {
  KVLayout l;
  l.num_layers = layers;
  l.num_pages = pages;
  l.page_size = 16;
  l.num_kv_heads = 8;
  l.head_dim = 128;
  l.has_v = has_v;
  l.cache_order = co;
  l.page_order = po;
  return l;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_corpus OUT_DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  std::vector<KVTransferInfo> infos = {
      {},
      {"shm", {1, 2, 3, 4}},
      {"ucx", std::vector<std::uint8_t>(100, 7)},
      {"mooncake", {}},
  };
#if MSTAR_KV_FUZZ_SHM
  std::vector<ShmKVTransferInfo> shm;
  // Seeds 0-2: layer-major, page-major, layer_page without V.
  for (int i = 0; i < 3; ++i) {
    ShmKVTransferInfo s;
    s.pid = 1234 + static_cast<std::uint32_t>(i);
    s.fd = 5;
    s.uid = 1000;
    s.start_time = 987654;
    s.nonce = 0x1122334455667788ULL + static_cast<std::uint64_t>(i);
    s.layout = layout(4 + static_cast<std::uint32_t>(i), 64, i != 2,
                      i == 1   ? CacheOrder::kPageMajor
                      : i == 2 ? CacheOrder::kLayerPage
                               : CacheOrder::kLayerMajor,
                      i == 0 ? PageOrder::kNHD : PageOrder::kHND);
    s.size = s.layout.total_bytes();
    shm.push_back(s);
    infos.push_back(s.encode());
    write(out / "fuzz_shm_info", "seed" + std::to_string(i), s.encode().payload, false);
    // The same cache private (cross-memory attach): one region, or one per
    // layer of a layer-major layout.
    ShmKVTransferInfo c = s;
    c.access = ShmKVTransferInfo::Access::kCma;
    c.fd = 0;
    c.anchor = 0x7f0000000000ULL;
    c.epochs_addr = 0x7f0000100000ULL;
    c.ready_addr = 0x7f0000200000ULL;
    const bool split = c.layout.cache_order != CacheOrder::kPageMajor;
    c.region_bytes = split ? c.layout.layer_bytes() : c.layout.total_bytes();
    for (std::uint32_t l = 0; l < (split ? c.layout.num_layers : 1u); ++l) {
      c.regions.push_back(0x7f1000000000ULL + std::uint64_t{l} * 0x100000000ULL);
    }
    c.size = split ? c.layout.total_bytes() : c.region_bytes;
    infos.push_back(c.encode());
    write(out / "fuzz_shm_info", "cma" + std::to_string(i), c.encode().payload, false);
  }
#endif
  // Seeds 0-3: layer-major, layer-major HND without V, page-major,
  // layer_page HND.
  for (int i = 0; i < 4; ++i) {
    const KVLayout l = layout(2 + static_cast<std::uint32_t>(i), 32, i != 1,
                              i == 2   ? CacheOrder::kPageMajor
                              : i == 3 ? CacheOrder::kLayerPage
                                       : CacheOrder::kLayerMajor,
                              i % 2 == 1 ? PageOrder::kHND : PageOrder::kNHD);
    const std::string name = "seed" + std::to_string(i);
    (void)l;
    (void)name;
#if MSTAR_KV_FUZZ_UCX
    UcxKVTransferInfo u;
    u.entity_id = "prefill-" + std::to_string(i);
    u.session_id = "127.0.0.1:2" + std::to_string(1000 + i);
    u.data_ptr = 0x7f0000000000ULL + 0x1000ULL * static_cast<std::uint64_t>(i);
    u.size = l.total_bytes() + 4096u * static_cast<std::uint64_t>(i);
    u.layout = l;
    u.generation = 0xabcdef + static_cast<std::uint64_t>(i);
    u.rkey.assign(static_cast<std::size_t>(10 + 20 * i), static_cast<std::uint8_t>(i + 1));
    infos.push_back(u.encode());
    write(out / "fuzz_ucx_info", name, u.encode().payload, false);
#endif
#if MSTAR_KV_FUZZ_MOONCAKE
    MooncakeKVTransferInfo m;
    m.entity_id = "prefill-" + std::to_string(i);
    m.session_id = "127.0.0.1:1" + std::to_string(7000 + i);
    m.data_ptr = 0x7f1000000000ULL;
    m.layout = l;
    m.size = l.total_bytes();
    m.generation = 77 + static_cast<std::uint64_t>(i);
    m.identity_ptr = 0x7f2000000000ULL;
    m.epochs_ptr = 0x7f2000100000ULL;
    m.ready_ptr = 0x7f2000200000ULL;
    infos.push_back(m.encode());
    write(out / "fuzz_mooncake_info", name, m.encode().payload, false);
#endif
#if MSTAR_KV_FUZZ_CUDA_IPC
    CudaIpcKVTransferInfo c;
    c.cuda_share.handle.fill(static_cast<std::uint8_t>(0x10 + i));
    c.cuda_share.device = i;
    c.cuda_share.device_uuid.fill(static_cast<std::uint8_t>(0x20 + i));
    c.cuda_share.allocation_bytes = l.total_bytes() + 2u * 1024 * 1024;
    c.layout = l;
    c.size = CudaIpcKVTransferInfo::view_size(l);
    c.stride = CudaIpcKVTransferInfo::view_stride(l);
    c.offset = 0;
    c.dtype = "bf16";
    c.generation = 99 + static_cast<std::uint64_t>(i);
    c.owner_pid = 4242;
    if (i % 2 == 0) {  // as a KVCachePool over a cuda_ipc cache publishes it
      c.has_epoch_table = true;
      c.epoch_handle.fill(static_cast<std::uint8_t>(0x30 + i));
      c.epoch_pages = l.num_pages;
      c.has_host_tables = true;  // and its host tables (layer readiness)
      c.host_tables_fd = 17;
      c.host_tables_uid = 1000;
    }
    try {
      infos.push_back(c.encode());
      write(out / "fuzz_cuda_ipc_info", name, c.encode().payload, false);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cuda_ipc seed %d: %s\n", i, e.what());
      return 1;
    }
#endif
  }
  for (std::size_t i = 0; i < infos.size(); ++i) {
    // Half of the seeds carry a sequence's page epoch (as published), half
    // the cache's own descriptor (epoch 0).
    if (i % 2 == 1 && !infos[i].empty()) infos[i].epoch = 0x1234567800000000ULL + i;
    write(out / "fuzz_transfer_info", "seed" + std::to_string(i), infos[i].encode(), true);
    SequenceInfo s;
    s.seq_id = 42 + i;
    s.num_tokens = 16 * i + 3;
    s.page_size = 16;  // i + 1 pages
    for (std::uint32_t p = 0; p <= i; ++p) s.page_indices.push_back(p * 7 % 64);
    s.kv_transfer_info = infos[i];
    s.lease_expiry_ms = i % 3 == 0 ? 0 : 1764700000000ULL + i;  // 0: no lease
    write(out / "fuzz_sequence_info", "seed" + std::to_string(i), s.encode(), true);
  }
  // Sequences that share pages (prefix caching): their descriptors carry
  // page_epochs, the section after the frame's last field.
  for (std::uint32_t i = 0; i < 2; ++i) {
    SequenceInfo s;
    s.seq_id = 900 + i;
    s.num_tokens = 16 * 4 - i;
    s.page_size = 16;
    s.page_indices = {3, 9, 1, 12};
    s.kv_transfer_info = {"shm", {1, 2, 3, 4}, 0x1234567800000100ULL + i, {}};
    s.kv_transfer_info.page_epochs.push_back({1, 0x1234567800000001ULL});
    if (i == 1) s.kv_transfer_info.page_epochs.push_back({9, 0x1234567800000002ULL});
    s.lease_expiry_ms = 1764700000000ULL;
    const std::string name = "shared" + std::to_string(i);
    write(out / "fuzz_transfer_info", name, s.kv_transfer_info.encode(), true);
    write(out / "fuzz_sequence_info", name, s.encode(), true);
  }
  // The planner target draws everything from its bytes: a few fixed strings.
  std::uint64_t x = 0x9E3779B97F4A7C15ULL;
  for (int i = 0; i < 8; ++i) {
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(48 + 40 * i));
    for (auto& b : bytes) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      b = static_cast<std::uint8_t>(x);
    }
    write(out / "fuzz_plan", "seed" + std::to_string(i), bytes, false);
  }
  return 0;
}
