// Copyright mstar-kv authors.
//
// PyCallback and its dispatcher thread: futures resolved on engine threads
// reach Python without an engine thread ever waiting for the GIL.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "py_common.hpp"

namespace mstar::kv::py {

class Dispatcher {
 public:
  static Dispatcher& get() {
    static Dispatcher* d = new Dispatcher;  // lives until exit; see stop()
    return *d;
  }

  // A call (status set) or, with call == false, only the release of fn.
  void post(PyObject* fn, bool call, Status status, std::uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;  // at exit: drop (never touch Python from here)
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    queue_.push_back(Job{fn, call, std::move(status), bytes});
    cv_.notify_one();
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Job {
    PyObject* fn;
    bool call;
    Status status;
    std::uint64_t bytes;
  };

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
      if (stopped_) return;
      std::deque<Job> jobs;
      jobs.swap(queue_);
      lock.unlock();
      if (python_alive()) {
        nb::gil_scoped_acquire gil;
        for (Job& j : jobs) {
          if (j.call) {
            PyObject* r = PyObject_CallFunction(j.fn, "isK", static_cast<int>(j.status.code()),
                                                j.status.message().c_str(),
                                                static_cast<unsigned long long>(j.bytes));
            if (r == nullptr) {
              PyErr_WriteUnraisable(j.fn);
            } else {
              Py_DECREF(r);
            }
          }
          Py_DECREF(j.fn);
        }
      }
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;  // guarded by mu_
  bool stopped_ = false;   // guarded by mu_
  std::thread thread_;
};

PyCallback::PyCallback(nb::handle fn) : fn_(fn.ptr()) { Py_XINCREF(fn_); }

PyCallback::~PyCallback() {
  if (fn_ != nullptr) Dispatcher::get().post(fn_, false, Status::ok(), 0);
}

void PyCallback::call_resolved(const Status& status, std::uint64_t bytes) {
  PyObject* fn = fn_;
  fn_ = nullptr;  // called once: the dispatcher owns the reference now
  if (fn != nullptr) Dispatcher::get().post(fn, true, status, bytes);
}

void stop_dispatcher() {
  nb::gil_scoped_release release;  // the dispatcher may be waiting for the GIL
  Dispatcher::get().stop();
}

void bind_callbacks(nb::module_& m) {
  m.def("_stop_callbacks", &stop_dispatcher,
        "Stops the thread that runs future callbacks (mstar_kv calls it at exit).");
}

}  // namespace mstar::kv::py
