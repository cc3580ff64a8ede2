// Ordering an optimizer's device state across calls on different streams (docs/abi.md,
// Streams): a stream is borrowed for one call, so a plugin that keeps device memory between
// calls records an event on the call's stream after its last use there, and the next call,
// on whatever stream it brings, first makes that stream wait for the event. The old stream
// is never touched after its call returned (it may be gone by then).
//
// Plain C++ interface (the CUDA runtime stays in stream_order.cpp, part of the kernels
// library); errors come back as strings, empty on success, like kernels/cuda.hpp.
#pragma once

#include <string>

namespace loom::optim::cuda {

// Creates *event on `device` on first use, then records it after the work queued so far on
// `stream` (a cudaStream_t; NULL is the legacy default stream).
std::string event_record(void** event, void* stream, int device);
// Work queued on `stream` after this call starts after `event`'s last record.
std::string event_wait(void* event, void* stream, int device);
// The host waits until the work before `event`'s last record is done (NULL: no-op).
std::string event_synchronize(void* event);
// Destroys an event (NULL is fine); pending waits on it are unaffected.
void event_destroy(void* event);

// One instance's ordering: begin() at the start of a call's device work, end() after it.
class StreamOrder {
 public:
  StreamOrder() = default;
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;
  ~StreamOrder() { event_destroy(event_); }

  // `stream` waits for the last call's work when that call used another stream (or another
  // device: the event is then recreated on this one by end()).
  std::string begin(void* stream, int device) {
    if (event_ == nullptr || (stream == last_ && device == device_)) return {};
    return event_wait(event_, stream, device);
  }
  // Marks the call's work on `stream` (the next call's begin() waits for it).
  std::string end(void* stream, int device) {
    if (event_ != nullptr && device != device_) {
      event_destroy(event_);
      event_ = nullptr;
    }
    std::string e = event_record(&event_, stream, device);
    if (e.empty()) {
      last_ = stream;
      device_ = device;
    }
    return e;
  }
  // The host waits for the last call's work (for a call without a stream, e.g. an export
  // that copies on the legacy default stream).
  std::string synchronize() const { return event_synchronize(event_); }
  // The stream of the last end(), and whether there was one.
  void* last_stream() const { return last_; }
  bool used() const { return event_ != nullptr; }

 private:
  void* event_ = nullptr;  // a cudaEvent_t on device_
  void* last_ = nullptr;
  int device_ = 0;
};

}  // namespace loom::optim::cuda
