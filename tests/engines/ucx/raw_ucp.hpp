// Copyright mstar-kv authors.
//
// The UCP objects of a raw peer in the ucx tests (raw_client.hpp,
// raw_owner.hpp): a context with active messages and one worker, waiting
// for a request UCX returned, closing an endpoint by force. Declared first
// in its user, so that it is released last.
#pragma once

#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

namespace mstar::kv::testing {

struct RawUcp {
  RawUcp() {
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, config, &context), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(context, &wp, &worker), UCS_OK);
  }
  ~RawUcp() {
    if (worker) ucp_worker_destroy(worker);
    if (context) ucp_cleanup(context);
  }
  RawUcp(const RawUcp&) = delete;
  RawUcp& operator=(const RawUcp&) = delete;

  // Progresses the worker until the request `sp` completed, then frees it.
  void wait(ucs_status_ptr_t sp) const {
    while (UCS_PTR_IS_PTR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS) {
      ucp_worker_progress(worker);
    }
    if (UCS_PTR_IS_PTR(sp)) ucp_request_free(sp);
  }
  void close_by_force(ucp_ep_h ep) const {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    wait(ucp_ep_close_nbx(ep, &rp));
  }

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
};

}  // namespace mstar::kv::testing
