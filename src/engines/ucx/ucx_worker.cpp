// Copyright mstar-kv authors.
//
// UcxWorker: UCP set-up and release, the cache's registrations, control
// messages and endpoint closes (ucx_worker.hpp).
#include "ucx_worker.hpp"

#include <cstring>

#include "ucx_core.hpp"

namespace mstar::kv::ucx {

std::vector<std::uint8_t> pack_rkeys(const std::vector<std::vector<std::uint8_t>>& keys) {
  std::vector<std::uint8_t> out;
  auto u32 = [&out](std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  };
  u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) {
    u32(static_cast<std::uint32_t>(k.size()));
    out.insert(out.end(), k.begin(), k.end());
  }
  return out;
}

std::vector<std::string> printed_lines(const std::function<void(FILE*)>& print) {
  char* buf = nullptr;
  std::size_t size = 0;
  FILE* f = ::open_memstream(&buf, &size);
  if (f == nullptr) return {};
  print(f);
  std::fclose(f);
  const std::string text(buf, size);
  std::free(buf);
  std::vector<std::string> lines;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// Whether the context has an RDMA transport (rc or dc), where gets are
// one-sided: UCX 1.13 cannot be asked, but its configuration dump lists each
// resource as "transport/device" (the lanes of an endpoint: inspect_ep).
static bool has_rdma(ucp_context_h context) {
  for (const std::string& line :
       printed_lines([context](FILE* f) { ucp_context_print_info(context, f); })) {
    if (line.find("resource") == std::string::npos) continue;
    if (line.find(" rc_") != std::string::npos || line.find(" dc_") != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::vector<std::span<const std::uint8_t>> unpack_rkeys(std::span<const std::uint8_t> blob,
                                                        std::size_t count) {
  std::size_t at = 0;
  auto u32 = [&](const char* what) {
    if (blob.size() - at < 4) {
      throw Error(StatusCode::kCorruptDescriptor,
                  std::string("the owner's remote keys end before ") + what);
    }
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{blob[at + i]} << (8 * i);
    at += 4;
    return v;
  };
  const std::uint32_t n = u32("their count");
  if (n != count) {
    throw Error(StatusCode::kCorruptDescriptor, "the owner's blob holds " + std::to_string(n) +
                                                    " remote keys for its " +
                                                    std::to_string(count) + " layer regions");
  }
  std::vector<std::span<const std::uint8_t>> keys;
  keys.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint32_t len = u32("a key's length");
    if (len == 0 || len > blob.size() - at) {
      throw Error(StatusCode::kCorruptDescriptor, "remote key " + std::to_string(i) + " of " +
                                                      std::to_string(len) +
                                                      " bytes does not fit the owner's blob");
    }
    keys.push_back(blob.subspan(at, len));
    at += len;
  }
  if (at != blob.size()) {
    throw Error(StatusCode::kCorruptDescriptor, "the owner's remote keys are followed by " +
                                                    std::to_string(blob.size() - at) +
                                                    " unexpected bytes");
  }
  return keys;
}

UcxWorker::UcxWorker(UcxCore& core, std::shared_ptr<KVCache> cache, const std::string& entity_id,
                     const UcxOptions& options)
    : UcxPart(core, std::move(cache), options) {
  region_.entity_id = entity_id;
  // A cache of one region per layer: each layer registered and published
  // on its own (one layer is one region).
  if (cache_->split() && cache_->num_regions() > 1) {
    layer_bytes_ = cache_->layout().layer_bytes();
    for (std::size_t l = 0; l < cache_->num_regions(); ++l) {
      region_.layer_regions.push_back(cache_->regions().base(l));
    }
  }
  region_.data_ptr = cache_->regions().base(0);
  region_.size = cache_->size_bytes();
  region_.layout = cache_->layout();
  region_.generation = rma::new_generation();
  init_ucp();  // on failure the handles release what was made
}

void UcxWorker::init_ucp() {
  ucp_config_t* raw_config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &raw_config);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_config_read: " + ucs_str(st));
  const std::unique_ptr<ucp_config_t, decltype(&ucp_config_release)> config(raw_config,
                                                                            &ucp_config_release);
  // No zero-copy eager sends (unless UCX_ZCOPY_THRESH says otherwise): UCX
  // 1.13's tcp transport aborts the process (uct_iface.h:884, "comp->count
  // > 0") when a peer dies while an eager zero-copy send to it is in flight,
  // i.e. an owner died with a reader killed mid-reply (8 of 12 runs of
  // UcxDataPath.ReaderKilled... with ucx_am_proto=eager). Eager copies then
  // go through UCX's buffers; measured no slower (bench/README.md).
  if (std::getenv("UCX_ZCOPY_THRESH") == nullptr) {
    st = ucp_config_modify(config.get(), "ZCOPY_THRESH", "inf");
    if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_config_modify: " + ucs_str(st));
  }
  // TCP segments of 64 KiB instead of UCX's 8 KiB (unless UCX_TCP_TX_SEG_SIZE
  // / UCX_TCP_RX_SEG_SIZE say otherwise): replies cross as gathered
  // messages of up to 1 MiB, which UCX copies segment by segment (over
  // loopback the Llama-3-8B request 1.9-2.1 -> 3.1-3.7 GB/s; bench/README.md).
  // The keys without "TCP_": ucp_config_modify hands them to the transports.
  // A tuning only: a UCX that refuses the key keeps its own segment size.
  for (const char* key : {"TX_SEG_SIZE", "RX_SEG_SIZE"}) {
    if (std::getenv(("UCX_TCP_" + std::string(key)).c_str()) != nullptr) continue;
    const bool taken = ucp_config_modify(config.get(), key, "64k") == UCS_OK;
    if (!taken && std::getenv("MSTAR_KV_UCX_DEBUG") != nullptr) {
      std::fprintf(stderr, "mstar-kv ucx: UCX keeps its %s\n", key);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h ctx = nullptr;
  st = ucp_init(&params, config.get(), &ctx);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_init: " + ucs_str(st));
  context_ = Context(ctx);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  st = ucp_worker_create(context_.get(), &wp, &worker);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_worker_create: " + ucs_str(st));
  worker_ = Worker(worker);
  if (ucp_worker_get_efd(worker, &efd_) != UCS_OK) efd_ = -1;  // then poll busily

  rows_dt_ = RowDatatype::create_source();
  sink_dt_ = RowDatatype::create_sink();
  // One registration (and remote key) per region; none for device memory
  // (a UCX without CUDA cannot map it): it is only ever staged, so readers
  // get no worker address (no gets) and its pages are never sent from or
  // received into.
  std::vector<std::vector<std::uint8_t>> rkeys;
  const bool registered = cache_->memory_kind() != MemoryKind::kDevice;
  const std::size_t regions = region_.layer_regions.empty() ? 1 : region_.layer_regions.size();
  for (std::size_t i = 0; registered && i < regions; ++i) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = cache_->regions().pointer(i * layer_bytes_);
    mp.length = regions == 1 ? cache_->size_bytes() : layer_bytes_;
    ucp_mem_h memh = nullptr;
    st = ucp_mem_map(context_.get(), &mp, &memh);
    if (st != UCS_OK) {
      throw Error(StatusCode::kUnavailable,
                  "ucp_mem_map of " + std::to_string(mp.length) + " bytes" +
                      (regions == 1 ? std::string() : " (layer " + std::to_string(i) + ")") + ": " +
                      ucs_str(st));
    }
    memhs_.emplace_back(context_.get(), memh);
    void* rkey_buf = nullptr;
    std::size_t rkey_len = 0;
    st = ucp_rkey_pack(context_.get(), memh, &rkey_buf, &rkey_len);
    if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_rkey_pack: " + ucs_str(st));
    const std::unique_ptr<void, decltype(&ucp_rkey_buffer_release)> keep(rkey_buf,
                                                                         &ucp_rkey_buffer_release);
    rkeys.emplace_back(static_cast<std::uint8_t*>(rkey_buf),
                       static_cast<std::uint8_t*>(rkey_buf) + rkey_len);
  }
  // The remote keys (gets) only where gets are one-sided, or where the owner
  // allows emulated ones (ucx_emulated_gets): UCX 1.13 serves a get over tcp
  // or shared memory with active messages, and a reader killed mid-get
  // aborted the owner in ucp_get_req_handler over tcp ("unexpected error:
  // Endpoint timeout", 12 of 60 runs of a killed get reader) and, over
  // shared memory, stalled its receive fifo for every reader or crashed it
  // in ucp_worker_destroy (1 in 40-100 runs). Without them a get reader is
  // refused at connect (ucx_reader.cpp).
  if (registered && (options_.emulated_gets || has_rdma(context_.get()))) {
    region_.backend_blob = regions == 1 ? std::move(rkeys[0]) : pack_rkeys(rkeys);
  }
  if (region_.backend_blob.size() > rma::RmaRegionInfo::kMaxBlobBytes) {
    throw Error(StatusCode::kUnavailable,
                "the remote keys of the cache's " + std::to_string(regions) + " regions take " +
                    std::to_string(region_.backend_blob.size()) + " bytes, beyond a descriptor's " +
                    std::to_string(rma::RmaRegionInfo::kMaxBlobBytes));
  }

  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) throw Error(StatusCode::kUnavailable, "ucp_worker_get_address: " + ucs_str(st));
  {
    auto release = [worker](ucp_address_t* a) { ucp_worker_release_address(worker, a); };
    const std::unique_ptr<ucp_address_t, decltype(release)> keep(addr, release);
    if (registered) {
      worker_address_.assign(reinterpret_cast<std::uint8_t*>(addr),
                             reinterpret_cast<std::uint8_t*>(addr) + addr_len);
    }
  }

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = trampoline<&UcxCore::on_am, AmGuard>;
  for (unsigned id : {kAmHello, kAmHelloReply, kAmReadReq, kAmReadData, kAmReadErr, kAmReadFin,
                      kAmDone, kAmChallenge, kAmAuth, kAmGatherData, kAmReadyReq, kAmReadyNotice,
                      kAmPing, kAmPong, kAmBind, kAmBound}) {
    am_tags_[id] = AmTag{&core_, id};
    hp.id = id;
    hp.arg = &am_tags_[id];
    st = ucp_worker_set_am_recv_handler(worker, &hp);
    if (st != UCS_OK) {
      throw Error(StatusCode::kUnavailable, "ucp_worker_set_am_recv_handler: " + ucs_str(st));
    }
  }
}

void UcxWorker::send_small(ucp_ep_h ep, unsigned id, const void* header, std::size_t header_len,
                           const void* data, std::size_t data_len, bool reply, std::uint64_t conn) {
  auto msg = std::make_unique<Control>();
  msg->core = &core_;
  msg->conn_id = conn;
  msg->id = id;
  msg->bytes.resize(header_len + data_len);
  if (header_len) std::memcpy(msg->bytes.data(), header, header_len);
  if (data_len) std::memcpy(msg->bytes.data() + header_len, data, data_len);
  Control* block = controls_.add(std::move(msg));
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  rp.cb.send = trampoline<&UcxWorker::on_control_sent, RequestGuard>;
  rp.user_data = static_cast<Pending*>(block);
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, id, block->bytes.data(), header_len,
                                        block->bytes.data() + header_len, data_len, &rp);
  if (UCS_PTR_IS_PTR(sp)) return;
  controls_.take(block);  // done (or failed) at once
  if (UCS_PTR_IS_ERR(sp) && conn != 0) core_.reader().message_failed(conn, id, UCS_PTR_STATUS(sp));
}

void UcxWorker::on_control_sent(void* req, ucs_status_t st, void* ud) {
  const Request freed(req);
  auto* c = context_of<Control>(ud);
  UcxCore* core = c->core;
  const std::uint64_t conn = c->conn_id;
  const unsigned id = c->id;
  core->worker().control_requests().take(c);
  if (st != UCS_OK && conn != 0) core->reader().message_failed(conn, id, st);
}

void UcxWorker::close_ep(Endpoint ep, std::vector<RemoteKey> rkeys, std::shared_ptr<Conn> keep) {
  Request closing = close(ep);
  if (closing) closing_.push_back({std::move(rkeys), std::move(closing), std::move(keep)});
}

void UcxWorker::reap_closing(bool force) {
  std::erase_if(closing_, [force](const Closing& c) { return force || done(c.request); });
}

void UcxWorker::release() noexcept {
  memhs_.clear();
  worker_.reset();
  context_.reset();
  // Now nothing can complete or write any more.
  reads_.clear();
  sends_.clear();
  controls_.clear();
}

}  // namespace mstar::kv::ucx
