// Copyright mstar-kv authors.
//
// The identity page of the Mooncake engine, for mstar_kv's engine over the
// Mooncake wheel: the same bytes the C++ Mooncake engine registers and
// checks (u64 magic | u32 length | RmaRegionInfo payload | u32 CRC-32C), so
// owners and readers of either kind understand each other, and the same
// verification (engines/rma: stale generation, forged region, layout).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "engines/mooncake/mooncake_backend.hpp"
#include "engines/mooncake/mooncake_words.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "py_common.hpp"
#include "rma/rma_backend.hpp"
#include "rma/rma_engine.hpp"

namespace mstar::kv::py {

namespace mc = mooncake;

namespace {

using Spans = std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>>;

Spans spans_of(const mc::WordReads& w) {
  Spans out;
  for (const auto& r : w.reads) out.emplace_back(r.local_offset, r.remote_offset, r.length);
  return out;
}

std::span<const std::byte> bytes_of(const nb::bytes& b) {
  return {static_cast<const std::byte*>(b.data()), b.size()};
}

void raise_unless_ok(const Status& st) {
  if (!st.is_ok()) throw Error(st);
}

// The wheel engine's reads of an owner's page epochs around a read, and
// their check (the C++ engine's, mooncake_words.hpp).
struct EpochWords {
  std::vector<std::uint32_t> pages;
  std::uint64_t epoch = 0;
  mc::WordReads reads;
};

// The wheel engine's layer watch: one round's reads and its check.
struct WatchWords {
  std::vector<std::uint32_t> pages;
  std::uint64_t epoch = 0;
  std::uint32_t num_layers = 0;
  mc::WatchReads reads;
};

// Pages for the word reads: at least one (Error(kInvalidArgument) naming
// `what` otherwise; word_reads' own refusal is an internal error).
std::vector<std::uint32_t> word_pages(nb::handle seq, const char* what) {
  std::vector<std::uint32_t> pages = to_pages(seq, what);
  if (pages.empty()) {
    throw Error(StatusCode::kInvalidArgument, std::string(what) + " is empty: no words to read");
  }
  return pages;
}

}  // namespace

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
        const rma::RmaRegionInfo served =
            mc::read_identity(std::span<const std::uint8_t>(
                                  static_cast<const std::uint8_t*>(page.data()), page.size()),
                              "at " + claimed.session_id);
        rma::verify_region(served, rma::RmaRegionInfo::decode(claimed.encode().payload));
      },
      nb::arg("page"), nb::arg("claimed"),
      "Checks a descriptor against the identity page its owner serves: "
      "StaleDescriptorError (other generation), PermissionDeniedError (forged region), "
      "IncompatibleLayoutError, InvalidArgumentError (other entity).");

  nb::class_<EpochWords>(m, "_MooncakeEpochWords",
                         "The reads of an owner's page epochs of `pages` (in runs) into a "
                         "scratch buffer of `nbytes`, and their check.")
      .def(
          "__init__",
          [](EpochWords* self, nb::handle pages, std::uint64_t epoch) {
            auto p = word_pages(pages, "pages");
            auto reads = mc::word_reads(p, 8);
            new (self) EpochWords{std::move(p), epoch, std::move(reads)};
          },
          nb::arg("pages"), nb::arg("epoch"))
      .def_prop_ro(
          "reads", [](const EpochWords& w) { return spans_of(w.reads); },
          "(scratch offset, offset from the epoch table's base, length) per read.")
      .def_prop_ro("nbytes", [](const EpochWords& w) { return w.reads.bytes; })
      .def(
          "check",
          [](const EpochWords& w, const nb::bytes& scratch, const std::string& when) {
            raise_unless_ok(
                mc::check_epoch_words(w.reads, w.pages, bytes_of(scratch), w.epoch, when));
          },
          nb::arg("scratch"), nb::arg("when"),
          "StaleDescriptorError naming the first page whose epoch in `scratch` is not the "
          "sequence's.");

  nb::class_<WatchWords>(m, "_MooncakeWatchWords",
                         "One round of a layer watch over `pages`: the epochs, the readiness "
                         "words and the epochs again (phases 0, 1, 2) into a scratch buffer of "
                         "`nbytes`, and the round's check.")
      .def(
          "__init__",
          [](WatchWords* self, nb::handle pages, std::uint64_t epoch, std::uint32_t num_layers) {
            auto p = word_pages(pages, "pages");
            auto reads = mc::watch_reads(p);
            new (self) WatchWords{std::move(p), epoch, num_layers, std::move(reads)};
          },
          nb::arg("pages"), nb::arg("epoch"), nb::arg("num_layers"))
      .def(
          "reads",
          [](const WatchWords& w, int phase) {
            if (phase < 0 || phase > 2) {
              throw Error(StatusCode::kInvalidArgument,
                          "watch phase " + std::to_string(phase) + " out of range [0, 2]");
            }
            return spans_of(w.reads.phase[phase]);
          },
          nb::arg("phase"),
          "Phase 0 and 2 read the epoch table, 1 the readiness words: (scratch offset, offset "
          "from that table's base, length) per read.")
      .def_prop_ro("nbytes", [](const WatchWords& w) { return w.reads.bytes; })
      .def(
          "check",
          [](const WatchWords& w, const nb::bytes& scratch, std::uint32_t floor) {
            std::uint32_t ready = 0;
            raise_unless_ok(mc::check_watch_words(w.reads, w.pages, bytes_of(scratch), w.epoch,
                                                  w.num_layers, floor, &ready));
            return ready;
          },
          nb::arg("scratch"), nb::arg("floor"),
          "Layers ready on every page; StaleDescriptorError (a page changed owner), "
          "CorruptDescriptorError (a word beyond the layers, or below `floor`).");
}

}  // namespace mstar::kv::py
