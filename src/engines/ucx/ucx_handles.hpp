// Copyright mstar-kv authors.
//
// Move-only owners of the UCP objects the ucx engine creates (internal to
// the engine): the context, the worker, the memory registration, the
// listener, endpoints and remote keys. Each destructor releases what its
// handle holds; a moved-from or default handle holds nothing. None is
// thread-safe: the engine uses them on its progress thread, or before it
// starts and after it joined.
//
// Release order matters to UCP (a registration, a listener and endpoints
// before their worker, the worker before its context); UcxCore declares its
// handles in creation order so that destruction runs in reverse.
#pragma once

#include <ucp/api/ucp.h>

#include <utility>

namespace mstar::kv::ucx {

// One UCP object of type H, released by Release(H).
template <class H, auto Release>
class Handle {
 public:
  Handle() = default;
  explicit Handle(H h) noexcept : h_(h) {}
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }

  H get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  // Gives the object up without releasing it.
  H release() noexcept { return std::exchange(h_, nullptr); }
  void reset() noexcept {
    if (h_ != nullptr) Release(std::exchange(h_, nullptr));
  }

 private:
  H h_ = nullptr;
};

using Context = Handle<ucp_context_h, &ucp_cleanup>;
using Worker = Handle<ucp_worker_h, &ucp_worker_destroy>;
using Listener = Handle<ucp_listener_h, &ucp_listener_destroy>;
using RemoteKey = Handle<ucp_rkey_h, &ucp_rkey_destroy>;

// A memory registration: unmapped through the context that mapped it.
class MemReg {
 public:
  MemReg() = default;
  MemReg(ucp_context_h ctx, ucp_mem_h memh) noexcept : ctx_(ctx), memh_(memh) {}
  MemReg(MemReg&& o) noexcept
      : ctx_(std::exchange(o.ctx_, nullptr)), memh_(std::exchange(o.memh_, nullptr)) {}
  MemReg& operator=(MemReg&& o) noexcept {
    if (this != &o) {
      reset();
      ctx_ = std::exchange(o.ctx_, nullptr);
      memh_ = std::exchange(o.memh_, nullptr);
    }
    return *this;
  }
  MemReg(const MemReg&) = delete;
  MemReg& operator=(const MemReg&) = delete;
  ~MemReg() { reset(); }

  ucp_mem_h get() const noexcept { return memh_; }
  void reset() noexcept {
    if (memh_ != nullptr) ucp_mem_unmap(ctx_, std::exchange(memh_, nullptr));
  }

 private:
  ucp_context_h ctx_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

// A request UCX returned (an endpoint's close): freed by its destructor,
// completed or not (UCX then completes it internally, without callback).
using Request = Handle<void*, &ucp_request_free>;

inline bool done(const Request& r) noexcept {
  return !r || ucp_request_check_status(r.get()) != UCS_INPROGRESS;
}

// A forced close: UCX purges the endpoint's requests (their callbacks run
// with an error) before the close completes, on the worker's progress.
inline Request close_endpoint(ucp_ep_h ep) noexcept {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &rp);
  return UCS_PTR_IS_PTR(sp) ? Request(sp) : Request();
}
inline void close_endpoint_and_forget(ucp_ep_h ep) noexcept { close_endpoint(ep); }

// An endpoint: closed by close() (whose request the caller keeps until it
// completes) or, still open, by the destructor (its request let go).
using Endpoint = Handle<ucp_ep_h, &close_endpoint_and_forget>;

inline Request close(Endpoint& ep) noexcept {
  return ep ? close_endpoint(ep.release()) : Request();
}

}  // namespace mstar::kv::ucx
