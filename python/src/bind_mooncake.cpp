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

#include "engines/mooncake/mooncake_backend.hpp"
#include "engines/rma/rma_backend.hpp"
#include "engines/rma/rma_engine.hpp"
#include "mstar/kv/mooncake.hpp"
#include "py_common.hpp"

namespace mstar::kv::py {

namespace mc = mooncake;

void bind_mooncake(nb::module_& m) {
  m.def(
      "_mooncake_identity_page",
      [](const MooncakeKVTransferInfo& info) {
        std::string page(mc::kIdentityBytes, '\0');
        mc::write_identity(reinterpret_cast<std::byte*>(page.data()),
                           rma::RmaRegionInfo::decode(info.encode().payload));
        return nb::bytes(page.data(), page.size());
      },
      nb::arg("info"), "The 4096-byte identity page an owner registers for `info`.");

  m.def(
      "_mooncake_new_generation", []() -> std::uint64_t { return rma::new_generation(); },
      "A random, non-zero generation (as the C++ engines pick).");

  m.def(
      "_mooncake_verify_identity",
      [](const nb::bytes& page, const MooncakeKVTransferInfo& claimed) {
        const rma::RmaRegionInfo served = mc::read_identity(
            std::span<const std::uint8_t>(static_cast<const std::uint8_t*>(page.data()),
                                          page.size()),
            "at " + claimed.session_id);
        rma::verify_region(served, rma::RmaRegionInfo::decode(claimed.encode().payload));
      },
      nb::arg("page"), nb::arg("claimed"),
      "Checks a descriptor against the identity page its owner serves: "
      "StaleDescriptorError (other generation), PermissionDeniedError (forged region), "
      "IncompatibleLayoutError, InvalidArgumentError (other entity).");
}

}  // namespace mstar::kv::py
