// Copyright mstar-kv authors.
//
// Descriptors: KVTransferInfo, SequenceInfo and each engine's typed info.
// All pickle through their byte encoding (decoded as untrusted input).
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "py_common.hpp"
#if MSTAR_KV_PY_HAVE_UCX
#include "mstar/kv/engines/ucx.hpp"
#endif
#if MSTAR_KV_PY_HAVE_CUDA_IPC
#include "mstar/kv/engines/cuda_ipc.hpp"
#endif

namespace mstar::kv::py {

namespace {

nb::bytes to_bytes(const std::vector<std::uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

std::vector<std::uint8_t> from_bytes(const nb::bytes& b) {
  const auto* p = static_cast<const std::uint8_t*>(b.data());
  return {p, p + b.size()};
}

// Methods every typed info shares: encode()/decode() to and from the generic
// KVTransferInfo, to_bytes()/from_bytes(), equality, pickling.
template <typename Info, typename Class>
void typed_info_methods(Class& c) {
  c.def("encode", &Info::encode, "This descriptor as a KVTransferInfo.")
      .def_static("decode", &Info::decode, nb::arg("info"),
                  "Decodes a KVTransferInfo as untrusted input: InvalidArgumentError for "
                  "another engine's descriptor, CorruptDescriptorError naming the field.")
      .def("to_bytes", [](const Info& i) { return to_bytes(i.encode().encode()); })
      .def_static(
          "from_bytes",
          [](const nb::bytes& b) { return Info::decode(KVTransferInfo::decode(from_bytes(b))); },
          nb::arg("data"))
      .def("__eq__", [](const Info& a, const Info& b) { return a == b; })
      .def("__eq__", [](const Info&, nb::handle) { return false; })
      .def("__getstate__", [](const Info& i) { return to_bytes(i.encode().encode()); })
      .def("__setstate__", [](Info& self, const nb::bytes& b) {
        new (&self) Info(Info::decode(KVTransferInfo::decode(from_bytes(b))));
      });
}

std::string short_hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

std::vector<std::uint32_t> to_pages(nb::handle seq, const char* what) {
  std::vector<std::uint32_t> out;
  if (nb::isinstance<nb::list>(seq) || nb::isinstance<nb::tuple>(seq)) {
    const std::size_t n = nb::len(seq);
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      nb::handle item = seq[i];
      long long v = 0;
      if (!nb::try_cast<long long>(item, v)) {
        throw Error(StatusCode::kInvalidArgument,
                    std::string(what) + "[" + std::to_string(i) + "] is a " +
                        nb::cast<std::string>(nb::str(item.type().attr("__name__"))) +
                        ", not an int");
      }
      if (v < 0 || v > 0xffffffffLL) {
        throw Error(StatusCode::kInvalidArgument, std::string(what) + "[" + std::to_string(i) +
                                                      "] = " + std::to_string(v) +
                                                      " out of range [0, 2^32)");
      }
      out.push_back(static_cast<std::uint32_t>(v));
    }
    return out;
  }
  if (!nb::hasattr(seq, "__len__") || !nb::hasattr(seq, "__getitem__")) {
    throw Error(StatusCode::kInvalidArgument,
                std::string(what) + " must be a sequence of page indices, not " +
                    nb::cast<std::string>(nb::str(seq.type().attr("__name__"))));
  }
  return to_pages(nb::list(seq), what);  // range, numpy array, array.array, ...
}

KVTransferInfo to_transfer_info(nb::handle obj) {
  if (nb::isinstance<KVTransferInfo>(obj)) return nb::cast<KVTransferInfo>(obj);
  if (nb::isinstance<nb::bytes>(obj))
    return KVTransferInfo::decode(from_bytes(nb::cast<nb::bytes>(obj)));
  if (obj.is_none()) return {};
  if (nb::hasattr(obj, "encode")) {
    nb::object enc = obj.attr("encode")();
    if (nb::isinstance<KVTransferInfo>(enc)) return nb::cast<KVTransferInfo>(enc);
  }
  throw Error(StatusCode::kInvalidArgument,
              "kv_transfer_info of type " +
                  nb::cast<std::string>(nb::str(obj.type().attr("__name__"))) +
                  " is not a descriptor (expected a KVTransferInfo, an engine's info, or its "
                  "bytes)");
}

void bind_descriptors(nb::module_& m) {
  nb::class_<KVTransferInfo>(m, "KVTransferInfo",
                             "An engine's descriptor of its cache, opaque outside that engine: "
                             "the engine's name plus its payload. engine == '' stands for no "
                             "transfer engine (LocalOnlyKVTransferEngine, the spec's None).")
      .def(nb::init<>())
      .def(
          "__init__",
          [](KVTransferInfo* self, const std::string& engine, const nb::bytes& payload) {
            new (self) KVTransferInfo{engine, from_bytes(payload)};
          },
          nb::arg("engine"), nb::arg("payload"))
      .def_rw("engine", &KVTransferInfo::engine)
      .def_rw("epoch", &KVTransferInfo::epoch,
              "On a SequenceInfo's copy: the owner epoch of that sequence's pages (a read "
              "of pages that changed owner raises StaleDescriptorError); 0 on a cache's own "
              "descriptor (reads unchecked).")
      .def_prop_ro("payload", [](const KVTransferInfo& i) { return to_bytes(i.payload); })
      .def_prop_rw(
          "page_epochs",
          [](const KVTransferInfo& i) {
            nb::list out;
            for (const PageEpoch& pe : i.page_epochs) out.append(nb::make_tuple(pe.page, pe.epoch));
            return out;
          },
          [](KVTransferInfo& i, nb::handle pairs) {
            // Set from untrusted input (a vLLM request's params): checked
            // as a decoded frame's are, and nothing changes if refused.
            KVTransferInfo next = i;
            next.page_epochs.clear();
            for (nb::handle item : pairs) {
              if (!nb::isinstance<nb::sequence>(item) || nb::len(item) != 2) {
                throw Error(StatusCode::kInvalidArgument,
                            "page_epochs entries must be (page, epoch) pairs");
              }
              next.page_epochs.push_back(
                  {nb::cast<std::uint32_t>(item[0]), nb::cast<std::uint64_t>(item[1])});
            }
            KVTransferInfo::decode(next.encode());
            i = std::move(next);
          },
          "On a SequenceInfo's copy: [(page, epoch), ...], sorted by page, the pages whose "
          "epoch is not `epoch` (pages the sequence shares with an earlier one, read with "
          "the epoch their content was published under); empty for an unshared sequence.")
      .def("empty", &KVTransferInfo::empty)
      .def(
          "to_bytes", [](const KVTransferInfo& i) { return to_bytes(i.encode()); },
          "Versioned, checksummed 'MSKV' frame.")
      .def_static(
          "from_bytes", [](const nb::bytes& b) { return KVTransferInfo::decode(from_bytes(b)); },
          nb::arg("data"),
          "Untrusted decode: CorruptDescriptorError naming the field for truncated, "
          "oversized, wrong-version or corrupted bytes.")
      .def("__eq__", [](const KVTransferInfo& a, const KVTransferInfo& b) { return a == b; })
      .def("__eq__", [](const KVTransferInfo&, nb::handle) { return false; })
      .def("__repr__",
           [](const KVTransferInfo& i) {
             return "KVTransferInfo(engine='" + i.engine + "', " +
                    std::to_string(i.payload.size()) + " payload bytes" +
                    (i.page_epochs.empty()
                         ? std::string()
                         : ", " + std::to_string(i.page_epochs.size()) + " shared pages") +
                    ")";
           })
      .def("__getstate__", [](const KVTransferInfo& i) { return to_bytes(i.encode()); })
      .def("__setstate__", [](KVTransferInfo& self, const nb::bytes& b) {
        new (&self) KVTransferInfo(KVTransferInfo::decode(from_bytes(b)));
      });

  nb::class_<SequenceInfo>(m, "SequenceInfo",
                           "One request as published by the prefill side: entry i of "
                           "page_indices holds tokens [i*page_size, (i+1)*page_size).")
      .def(nb::init<>())
      .def(
          "__init__",
          [](SequenceInfo* self, std::uint64_t seq_id, std::uint64_t num_tokens,
             nb::handle page_indices, nb::handle kv_transfer_info, std::uint32_t page_size) {
            new (self) SequenceInfo{seq_id,
                                    num_tokens,
                                    to_pages(page_indices, "page_indices"),
                                    to_transfer_info(kv_transfer_info),
                                    0,
                                    page_size};
          },
          nb::arg("seq_id"), nb::arg("num_tokens"), nb::arg("page_indices"),
          nb::arg("kv_transfer_info").none() = nb::none(), nb::kw_only(), nb::arg("page_size"),
          "page_size: tokens per page of the owner's layout (from_bytes rejects a page count "
          "other than ceil(num_tokens / page_size)).")
      .def_rw("seq_id", &SequenceInfo::seq_id)
      .def_rw("num_tokens", &SequenceInfo::num_tokens)
      .def_rw("page_indices", &SequenceInfo::page_indices)
      .def_rw("kv_transfer_info", &SequenceInfo::kv_transfer_info)
      .def_rw("page_size", &SequenceInfo::page_size,
              "Tokens per page of the owner's layout (KVCachePool.publish sets it).")
      .def_rw("lease_expiry_ms", &SequenceInfo::lease_expiry_ms,
              "When the prefill side frees the sequence unless marked done (ms since the Unix "
              "epoch, the owner's clock; 0 = no lease).")
      .def("to_bytes", [](const SequenceInfo& s) { return to_bytes(s.encode()); })
      .def_static(
          "from_bytes", [](const nb::bytes& b) { return SequenceInfo::decode(from_bytes(b)); },
          nb::arg("data"), "Untrusted decode (CorruptDescriptorError naming the field).")
      .def("__eq__", [](const SequenceInfo& a, const SequenceInfo& b) { return a == b; })
      .def("__eq__", [](const SequenceInfo&, nb::handle) { return false; })
      .def("__repr__",
           [](const SequenceInfo& s) {
             return "SequenceInfo(seq_id=" + std::to_string(s.seq_id) +
                    ", num_tokens=" + std::to_string(s.num_tokens) + ", " +
                    std::to_string(s.page_indices.size()) + " pages of " +
                    std::to_string(s.page_size) + " tokens, engine='" + s.kv_transfer_info.engine +
                    "')";
           })
      .def("__getstate__", [](const SequenceInfo& s) { return to_bytes(s.encode()); })
      .def("__setstate__", [](SequenceInfo& self, const nb::bytes& b) {
        new (&self) SequenceInfo(SequenceInfo::decode(from_bytes(b)));
      });

  auto shm = nb::class_<ShmKVTransferInfo>(
      m, "ShmKVTransferInfo",
      "The shm engine's descriptor: owner pid, memfd, uid, start time, nonce, size, layout.");
  shm.def(nb::init<>())
      .def_prop_ro(
          "access",
          [](const ShmKVTransferInfo& i) {
            return i.access == ShmKVTransferInfo::Access::kCma ? "cma" : "memfd";
          },
          "'memfd' (a shared cache, mapped) or 'cma' (a private cache, read with "
          "process_vm_readv).")
      .def_rw("regions", &ShmKVTransferInfo::regions,
              "cma: the owner's region addresses (one, or one per layer).")
      .def_rw("region_bytes", &ShmKVTransferInfo::region_bytes)
      .def_rw("backed", &ShmKVTransferInfo::backed,
              "cma: the regions' whole pages are the owner's memfd `fd`, which readers map "
              "(the engine option shm_map_private).")
      .def_rw("anchor", &ShmKVTransferInfo::anchor)
      .def_rw("pid", &ShmKVTransferInfo::pid)
      .def_rw("fd", &ShmKVTransferInfo::fd)
      .def_rw("uid", &ShmKVTransferInfo::uid)
      .def_rw("start_time", &ShmKVTransferInfo::start_time)
      .def_rw("nonce", &ShmKVTransferInfo::nonce)
      .def_rw("size", &ShmKVTransferInfo::size)
      .def_rw("layout", &ShmKVTransferInfo::layout)
      .def("__repr__", [](const ShmKVTransferInfo& i) {
        if (i.access == ShmKVTransferInfo::Access::kCma) {
          return "ShmKVTransferInfo(pid=" + std::to_string(i.pid) +
                 (i.backed ? ", cma, mapped fd=" + std::to_string(i.fd) + ", " : ", cma, ") +
                 std::to_string(i.regions.size()) + " region(s), size=" + std::to_string(i.size) +
                 ", layout=" + i.layout.to_string() + ")";
        }
        return "ShmKVTransferInfo(pid=" + std::to_string(i.pid) + ", fd=" + std::to_string(i.fd) +
               ", size=" + std::to_string(i.size) + ", layout=" + i.layout.to_string() + ")";
      });
  typed_info_methods<ShmKVTransferInfo>(shm);

  auto mc = nb::class_<MooncakeKVTransferInfo>(
      m, "MooncakeKVTransferInfo",
      "The spec's MooncakeKVTransferInfo(entity_id, session_id, data_ptr, layout) plus what "
      "makes it checkable: size, generation and the owner's identity page.");
  mc.def(nb::init<>())
      .def(
          "__init__",
          [](MooncakeKVTransferInfo* self, const std::string& entity_id,
             const std::string& session_id, std::uint64_t data_ptr, const KVLayout& layout,
             std::uint64_t size, std::uint64_t generation, std::uint64_t identity_ptr,
             std::uint64_t epochs_ptr, std::uint64_t ready_ptr,
             std::vector<std::uint64_t> layer_regions) {
            new (self) MooncakeKVTransferInfo{
                entity_id,  session_id,   data_ptr,   layout,    size ? size : layout.total_bytes(),
                generation, identity_ptr, epochs_ptr, ready_ptr, std::move(layer_regions)};
          },
          nb::arg("entity_id"), nb::arg("session_id"), nb::arg("data_ptr"), nb::arg("layout"),
          nb::arg("size") = 0, nb::arg("generation") = 0, nb::arg("identity_ptr") = 0,
          nb::arg("epochs_ptr") = 0, nb::arg("ready_ptr") = 0,
          nb::arg("layer_regions") = std::vector<std::uint64_t>{})
      .def_rw("entity_id", &MooncakeKVTransferInfo::entity_id)
      .def_rw("session_id", &MooncakeKVTransferInfo::session_id)
      .def_rw("data_ptr", &MooncakeKVTransferInfo::data_ptr)
      .def_rw("layout", &MooncakeKVTransferInfo::layout)
      .def_rw("size", &MooncakeKVTransferInfo::size)
      .def_rw("generation", &MooncakeKVTransferInfo::generation)
      .def_rw("identity_ptr", &MooncakeKVTransferInfo::identity_ptr)
      .def_rw("epochs_ptr", &MooncakeKVTransferInfo::epochs_ptr,
              "The owner's registered page epoch table (num_pages 8-byte words).")
      .def_rw("ready_ptr", &MooncakeKVTransferInfo::ready_ptr,
              "The owner's registered layer readiness words (num_pages 4-byte words).")
      .def_rw("layer_regions", &MooncakeKVTransferInfo::layer_regions,
              "A cache of one region per layer: each layer's address (data_ptr is layer "
              "0's); empty for one region.")
      .def("__repr__", [](const MooncakeKVTransferInfo& i) {
        return "MooncakeKVTransferInfo(entity_id='" + i.entity_id + "', session_id='" +
               i.session_id + "', data_ptr=" + short_hex(i.data_ptr) +
               ", layout=" + i.layout.to_string() + ")";
      });
  typed_info_methods<MooncakeKVTransferInfo>(mc);

#if MSTAR_KV_PY_HAVE_UCX
  auto ucx = nb::class_<UcxKVTransferInfo>(
      m, "UcxKVTransferInfo",
      "The ucx engine's descriptor: entity id, session id ('HOST:PORT' of the owner's "
      "listener), data_ptr, size, layout, generation and the packed remote key.");
  ucx.def(nb::init<>())
      .def_rw("entity_id", &UcxKVTransferInfo::entity_id)
      .def_rw("session_id", &UcxKVTransferInfo::session_id)
      .def_rw("data_ptr", &UcxKVTransferInfo::data_ptr)
      .def_rw("size", &UcxKVTransferInfo::size)
      .def_rw("layout", &UcxKVTransferInfo::layout)
      .def_rw("generation", &UcxKVTransferInfo::generation)
      .def_prop_ro("rkey", [](const UcxKVTransferInfo& i) { return to_bytes(i.rkey); })
      .def("__repr__", [](const UcxKVTransferInfo& i) {
        return "UcxKVTransferInfo(entity_id='" + i.entity_id + "', session_id='" + i.session_id +
               "', layout=" + i.layout.to_string() + ")";
      });
  ucx.def("encode", &UcxKVTransferInfo::encode)
      .def_static("decode", &UcxKVTransferInfo::decode, nb::arg("info"))
      .def("to_bytes", [](const UcxKVTransferInfo& i) { return to_bytes(i.encode().encode()); })
      .def_static(
          "from_bytes",
          [](const nb::bytes& b) {
            return UcxKVTransferInfo::decode(KVTransferInfo::decode(from_bytes(b)));
          },
          nb::arg("data"))
      .def("__eq__", [](const UcxKVTransferInfo& a,
                        const UcxKVTransferInfo& b) { return a.encode() == b.encode(); })
      .def("__eq__", [](const UcxKVTransferInfo&, nb::handle) { return false; })
      .def("__getstate__", [](const UcxKVTransferInfo& i) { return to_bytes(i.encode().encode()); })
      .def("__setstate__", [](UcxKVTransferInfo& self, const nb::bytes& b) {
        new (&self)
            UcxKVTransferInfo(UcxKVTransferInfo::decode(KVTransferInfo::decode(from_bytes(b))));
      });
#endif

#if MSTAR_KV_PY_HAVE_CUDA_IPC
  auto cuda = nb::class_<CudaIpcKVTransferInfo>(
      m, "_CudaIpcKVTransferInfo",
      "Native form of CudaIpcKVTransferInfo (mstar_kv.CudaIpcKVTransferInfo builds it from "
      "torch's _share_cuda_() tuple).");
  cuda.def(nb::init<>())
      .def(
          "__init__",
          [](CudaIpcKVTransferInfo* self, const nb::bytes& handle, int device,
             const nb::bytes& device_uuid, std::uint64_t allocation_bytes,
             std::vector<std::int64_t> size, std::vector<std::int64_t> stride, std::int64_t offset,
             std::string dtype, bool requires_grad, const KVLayout& layout,
             std::uint64_t generation, std::uint32_t owner_pid) {
            CudaIpcKVTransferInfo i;
            if (handle.size() != CudaIpcShare::kHandleBytes) {
              throw Error(StatusCode::kInvalidArgument,
                          "CUDA IPC handle of " + std::to_string(handle.size()) +
                              " bytes, expected " + std::to_string(CudaIpcShare::kHandleBytes));
            }
            if (device_uuid.size() != i.cuda_share.device_uuid.size()) {
              throw Error(
                  StatusCode::kInvalidArgument,
                  "device_uuid of " + std::to_string(device_uuid.size()) + " bytes, expected 16");
            }
            std::memcpy(i.cuda_share.handle.data(), handle.data(), CudaIpcShare::kHandleBytes);
            std::memcpy(i.cuda_share.device_uuid.data(), device_uuid.data(), 16);
            i.cuda_share.device = device;
            i.cuda_share.allocation_bytes = allocation_bytes;
            i.size = std::move(size);
            i.stride = std::move(stride);
            i.offset = offset;
            i.dtype = std::move(dtype);
            i.requires_grad = requires_grad;
            i.layout = layout;
            i.generation = generation;
            i.owner_pid = owner_pid;
            i.validate();
            new (self) CudaIpcKVTransferInfo(std::move(i));
          },
          nb::arg("handle"), nb::arg("device"), nb::arg("device_uuid"), nb::arg("allocation_bytes"),
          nb::arg("size"), nb::arg("stride"), nb::arg("offset"), nb::arg("dtype"),
          nb::arg("requires_grad"), nb::arg("layout"), nb::arg("generation"), nb::arg("owner_pid"))
      .def_prop_ro("handle",
                   [](const CudaIpcKVTransferInfo& i) {
                     return nb::bytes(reinterpret_cast<const char*>(i.cuda_share.handle.data()),
                                      i.cuda_share.handle.size());
                   })
      .def_prop_ro("device", [](const CudaIpcKVTransferInfo& i) { return i.cuda_share.device; })
      .def_prop_ro("device_uuid",
                   [](const CudaIpcKVTransferInfo& i) {
                     return nb::bytes(
                         reinterpret_cast<const char*>(i.cuda_share.device_uuid.data()),
                         i.cuda_share.device_uuid.size());
                   })
      .def_prop_ro("allocation_bytes",
                   [](const CudaIpcKVTransferInfo& i) { return i.cuda_share.allocation_bytes; })
      .def_ro("size", &CudaIpcKVTransferInfo::size)
      .def_ro("stride", &CudaIpcKVTransferInfo::stride)
      .def_ro("offset", &CudaIpcKVTransferInfo::offset)
      .def_ro("dtype", &CudaIpcKVTransferInfo::dtype)
      .def_ro("requires_grad", &CudaIpcKVTransferInfo::requires_grad)
      .def_ro("layout", &CudaIpcKVTransferInfo::layout)
      .def_ro("generation", &CudaIpcKVTransferInfo::generation)
      .def_ro("owner_pid", &CudaIpcKVTransferInfo::owner_pid)
      .def_static("view_size", &CudaIpcKVTransferInfo::view_size, nb::arg("layout"))
      .def_static("view_stride", &CudaIpcKVTransferInfo::view_stride, nb::arg("layout"));
  typed_info_methods<CudaIpcKVTransferInfo>(cuda);
#endif
}

}  // namespace mstar::kv::py
