// Copyright mstar-kv authors.
//
// Emulated gets are served only when the owner asks (ucx_emulated_gets):
// without an RDMA transport UCX 1.13 emulates a get with active messages,
// and a reader killed mid-get aborted the owner over tcp (ucp_get_req_handler,
// "unexpected error: Endpoint timeout") and stalled or crashed it over shared
// memory. A default owner publishes no remote keys: a reader that asks for
// gets is refused at connect, naming the option, before any byte moves, and
// the owner goes on serving active-message readers; an owner that allows
// them serves the same reader every byte. (A bad value of the option:
// UcxOptions in ucx_engine_test.cpp.)
#include "common/expectations.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "ucx_fixture.hpp"

namespace mstar::kv::ucx_test {
namespace {

class UcxGetRefusal : public UcxFixture {};

TEST_P(UcxGetRefusal, ADefaultOwnerRefusesAGetReaderAndServesTheNextReader) {
  PeerSpec s = spec(layout(), 64 * 16);
  s.extra.erase("ucx_emulated_gets");
  PeerProcess owner(s);
  const SequenceInfo& seq = owner.sequence();
  const auto lp = iota_pages(seq.page_indices.size());

  auto refused = local_cache(layout());
  auto m = manager(refused, 5000ms, {{"ucx_emulated_gets", "off"}});
  testing::expect_error(
      [&] { m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info); },
      StatusCode::kUnavailable,
      {"ucx_mode=get, but the owner serves no gets", "ucx_emulated_gets=on"});
  EXPECT_TRUE(untouched(*refused)) << "a refused get reader's cache was written";

  auto served = local_cache(layout());
  auto am = manager(served, 5000ms, {{"ucx_mode", "am"}});
  EXPECT_EQ(am->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info),
            layout().total_bytes());
  const auto v = verify_pattern(*served, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_P(UcxGetRefusal, AnOwnerThatAllowsEmulatedGetsServesTheGetReader) {
  PeerSpec s = spec(layout(), 64 * 16);
  ASSERT_EQ(s.extra.at("ucx_emulated_gets"), "on");
  PeerProcess owner(s);
  const SequenceInfo& seq = owner.sequence();
  const auto lp = iota_pages(seq.page_indices.size());
  auto cache = local_cache(layout());
  auto m = manager(cache, 5000ms, {{"ucx_emulated_gets", "off"}});  // the owner's choice
  EXPECT_EQ(m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info),
            layout().total_bytes());
  const auto v = verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxGetRefusal,
                         ::testing::Values(UcxCase{"tcp_get", "tcp", "get", ""},
                                           UcxCase{"shm_get", "sm,self,tcp", "get", ""}),
                         case_name);

}  // namespace
}  // namespace mstar::kv::ucx_test
