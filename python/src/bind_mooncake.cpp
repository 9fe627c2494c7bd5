// Copyright mstar-kv authors.
//
// The identity page of the Mooncake engine, for mstar_kv's engine over the
// Mooncake wheel: the same bytes the C++ Mooncake engine registers and
// checks (u64 magic | u32 length | RmaRegionInfo payload | u32 CRC-32C), so
// owners and readers of either kind understand each other, and the same
// verification (engines/rma: stale generation, forged region, layout).
#include <nanobind/stl/string.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/codec.hpp"
#include "engines/rma/rma_backend.hpp"
#include "engines/rma/rma_engine.hpp"
#include "mstar/kv/mooncake.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

namespace {

constexpr std::size_t kIdentityBytes = 4096;
constexpr std::uint64_t kIdentityMagic = 0x4449434d564b534dull;  // "MSKVMCID"

rma::RmaRegionInfo region_of(const MooncakeKVTransferInfo& info) {
  return rma::RmaRegionInfo::decode(info.encode().payload);
}

}  // namespace

void bind_mooncake(nb::module_& m) {
  m.def(
      "_mooncake_identity_page",
      [](const MooncakeKVTransferInfo& info) {
        codec::ByteWriter w;
        w.u64(kIdentityMagic);
        w.bytes(info.encode().payload);
        w.u32(codec::crc32c(w.data()));
        if (w.data().size() > kIdentityBytes) {
          throw Error(StatusCode::kInvalidArgument,
                      "Mooncake descriptor of " + std::to_string(w.data().size()) +
                          " bytes exceeds the identity page of " + std::to_string(kIdentityBytes));
        }
        std::string page(kIdentityBytes, '\0');
        std::memcpy(page.data(), w.data().data(), w.data().size());
        return nb::bytes(page.data(), page.size());
      },
      nb::arg("info"), "The 4096-byte identity page an owner registers for `info`.");

  m.def(
      "_mooncake_new_generation", []() -> std::uint64_t { return rma::new_generation(); },
      "A random, non-zero generation (as the C++ engines pick).");

  m.def(
      "_mooncake_verify_identity",
      [](const nb::bytes& page, const MooncakeKVTransferInfo& claimed) {
        const std::span<const std::uint8_t> bytes(static_cast<const std::uint8_t*>(page.data()),
                                                  page.size());
        rma::RmaRegionInfo served;
        try {
          codec::ByteReader r(bytes, "Mooncake identity page");
          if (r.u64("magic") != kIdentityMagic) r.fail("magic", "not an mstar-kv identity page");
          const auto payload = r.bytes("descriptor", kIdentityBytes - 16);
          const std::size_t used = 8 + 4 + payload.size();
          const std::uint32_t crc = r.u32("crc");
          if (crc != codec::crc32c(bytes.first(used))) r.fail("crc", "checksum mismatch");
          served = rma::RmaRegionInfo::decode(payload);
        } catch (const Error& e) {
          throw Error(StatusCode::kPermissionDenied,
                      "the descriptor's identity page at " + claimed.session_id +
                          " does not hold an mstar-kv descriptor (forged or stale): " + e.what());
        }
        rma::verify_region(served, region_of(claimed));
      },
      nb::arg("page"), nb::arg("claimed"),
      "Checks a descriptor against the identity page its owner serves: "
      "StaleDescriptorError (other generation), PermissionDeniedError (forged region), "
      "IncompatibleLayoutError, InvalidArgumentError (other entity).");
}

}  // namespace mstar::kv::py
