// Non-blocking collectives for a transport that has only blocking ones: a CollectiveQueue runs
// the transport's blocking calls in the order they were started, on one thread of its own,
// so the caller computes while they run (loom.comm/1's start, test and wait, ABI 1.6).
//
// A transport (a loom::sdk::Comm) opts in by owning one and returning it:
//
//   class MyComm : public loom::sdk::Comm {
//    public:
//     ~MyComm() { queue_.stop(); /* then tear down what the collectives use */ }
//     loom::sdk::CollectiveQueue& collective_queue() { return queue_; }
//     ...
//    private:
//     loom::sdk::CollectiveQueue queue_;
//   };
//
// The SDK then builds start, test and wait from it, and makes every blocking call wait for
// the queue to empty first, so all collectives keep one order. The transport's methods are
// then called from two threads, one at a time: the queue's for started collectives and the
// caller's for blocking ones. A stream-ordered transport (nccl), whose calls only queue
// device work, uses Mode::inline_calls: start runs the call on the caller's thread and the
// request is finished when it returns.
//
// stop() must be the first thing the transport's destructor does: a started collective may
// still be running on the queue's thread and use the transport's members.
#ifndef LOOM_SDK_COLLECTIVE_QUEUE_HPP
#define LOOM_SDK_COLLECTIVE_QUEUE_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace loom::sdk {

class CollectiveQueue {
 public:
  enum class Mode { background_thread, inline_calls };

  explicit CollectiveQueue(Mode mode = Mode::background_thread) : mode_(mode) {}
  ~CollectiveQueue() { stop(); }
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // Queues `job` (a blocking collective, with its arguments captured) and returns its request.
  // Throws FAILED_PRECONDITION after stop().
  void* start(std::function<void()> job) {
    auto req = std::make_unique<Request>();
    Request* raw = req.get();
    if (mode_ == Mode::inline_calls) {
      run(*raw, job);
      return req.release();
    }
    {
      const std::lock_guard lock(mu_);
      if (stopped_) {
        throw Error(LOOM_ERR_FAILED_PRECONDITION, "collective started after the transport stopped");
      }
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      jobs_.push_back({raw, std::move(job)});
      ++outstanding_;
    }
    cv_.notify_all();
    return req.release();
  }

  // True when the request's collective has finished. Throws its error (the request still needs
  // wait).
  bool test(void* request) {
    Request& r = checked(request);
    const std::lock_guard lock(mu_);
    if (!r.done) return false;
    if (r.error) std::rethrow_exception(r.error);
    return true;
  }

  // Blocks until the request's collective has finished, frees the request and throws its error
  // if it failed.
  void wait(void* request) {
    std::unique_ptr<Request> r(&checked(request));
    std::exception_ptr error;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return r->done; });
      error = r->error;
    }
    if (error) std::rethrow_exception(error);
  }

  // Blocks until every started collective has finished (their errors stay with their
  // requests). The SDK calls it before each blocking call.
  void drain() noexcept {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return outstanding_ == 0; });
  }

  // Lets the started collectives finish and joins the thread; later starts are refused.
  // Requests not yet waited for stay valid for wait (they leak if never waited for).
  void stop() noexcept {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return outstanding_ == 0; });
      stopped_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Request {
    bool done = false;
    std::exception_ptr error;
    static constexpr uint64_t kMagic = 0x6c6f6f6d72657131ULL;  // "loomreq1"
    uint64_t magic = kMagic;
  };
  struct Job {
    Request* request;
    std::function<void()> run;
  };

  static Request& checked(void* request) {
    auto* r = static_cast<Request*>(request);
    if (r == nullptr || r->magic != Request::kMagic) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "not a request of this transport (NULL or freed)");
    }
    return *r;
  }

  void run(Request& r, const std::function<void()>& job) {
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    const std::lock_guard lock(mu_);
    r.error = error;
    r.done = true;
  }

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopped_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopped, and nothing left
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      run(*job.request, job.run);
      {
        const std::lock_guard lock(mu_);
        --outstanding_;
      }
      cv_.notify_all();
    }
  }

  Mode mode_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  int outstanding_ = 0;  // queued or running
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace loom::sdk

#endif  // LOOM_SDK_COLLECTIVE_QUEUE_HPP
