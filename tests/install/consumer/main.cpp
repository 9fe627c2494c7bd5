#include <cstdio>
#include "mstar/kv/kv.hpp"
int main() {
  mstar::kv::KVLayout l;
  l.num_layers = 2;
  l.num_pages = 4;
  l.page_size = 16;
  l.num_kv_heads = 1;
  l.head_dim = 64;
  auto c = mstar::kv::make_kv_cache(l, mstar::kv::MemoryKind::kSharedHost);
  mstar::kv::KVTransferManager m(mstar::kv::TransferEngineInfo{"a", "", "shm", {}}, c);
  std::printf("engines:");
  for (auto& e : mstar::kv::built_engines()) std::printf(" %s", e.c_str());
  std::printf("\ndescriptor %zu bytes\n", m.get_kv_transfer_info().encode().size());
}
