// The per-step kernels of the optimizer plugins behind one declaration, with a CPU and a CUDA
// implementation: adam.cpp and lamb.cpp (and onebit.hpp, through onebit_backend.hpp, which
// extends this interface with the 1-bit family's primitives) write each algorithm's
// bookkeeping once and pick the implementation by the step's device.
//
//   Backend          the interface: fused Adam over the tensors of one group, and both
//                    LAMB passes (trust ratio included) over the tensors of one group;
//   CpuBackendT<B>   the CPU kernels (kernels/cpu.hpp: Highway, threaded);
//   CudaBackendT<B>  the CUDA kernels (kernels/cuda.hpp), every launch on the stream given
//                    to begin(); begin()/end() also order the device state kept between
//                    calls across streams (stream_order.hpp);
//   StepBackend      both, and the choice by a step's tensors (adam, lamb).
// The implementations are templates over their interface so that onebit_backend.hpp's
// larger interface inherits these two methods unchanged. Errors throw loom::sdk::Error
// (INTERNAL for a CUDA failure).
#pragma once

#include <loom/sdk.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common.hpp"
#include "kernels/cpu.hpp"
#include "kernels/cuda.hpp"
#include "stream_order.hpp"

namespace loom::optim {

class Backend {
 public:
  virtual ~Backend() = default;
  // One fused Adam step (kernels/cpu.hpp AdamHyper) over tensors sharing `h`.
  virtual void adam(const std::vector<TensorRef>& refs, const AdamHyper& h) = 0;
  // Both LAMB passes over tensors sharing `h`: per tensor p -= lr * coeff * u with
  // coeff = clamp(|p| / |u|, min_coeff, max_coeff) evaluated in fp32 (1 when a norm is 0).
  virtual void lamb(const std::vector<TensorRef>& refs, const LambHyper& h, double lr,
                    double min_coeff, double max_coeff) = 0;
};

template <class Interface = Backend>
class CpuBackendT : public Interface {
 public:
  void adam(const std::vector<TensorRef>& refs, const AdamHyper& h) override {
    for (const TensorRef& r : refs) adam_cpu(r, h);
  }
  void lamb(const std::vector<TensorRef>& refs, const LambHyper& h, double lr, double min_coeff,
            double max_coeff) override {
    for (const TensorRef& r : refs) {
      double sp = 0.0;
      double su = 0.0;
      lamb_moments_cpu(r, h, &sp, &su);
      lamb_apply_cpu(r, h, static_cast<float>(lr * trust_ratio(sp, su, min_coeff, max_coeff)));
    }
  }

 private:
  // Computed in fp32 like the CUDA kernel, so both pick the same coefficient.
  static double trust_ratio(double sum_p2, double sum_u2, double min_coeff, double max_coeff) {
    const double pn = std::sqrt(sum_p2);
    const double un = std::sqrt(sum_u2);
    if (!(pn > 0.0) || !(un > 0.0)) return 1.0;
    float c = static_cast<float>(pn / un);
    c = std::min(std::max(c, static_cast<float>(min_coeff)), static_cast<float>(max_coeff));
    return static_cast<double>(c);
  }
};
using CpuBackend = CpuBackendT<>;

template <class Interface = Backend>
class CudaBackendT : public Interface {
 public:
  // Starts a call's device work on `stream` (a cudaStream_t) and `device`: when the last
  // call's work was on another stream, this one first waits for it (an event).
  void begin(void* stream, int device) {
    ok(order_.begin(stream, device));
    stream_ = stream;
    device_ = device;
  }
  // Marks the end of the call's work on its stream, for the next begin(). Also after a call
  // that failed part-way (work may have been queued).
  void end() { ok(order_.end(stream_, device_)); }
  void* stream() const { return stream_; }
  // The host waits for the last call's work.
  void synchronize() const { ok(order_.synchronize()); }

  void adam(const std::vector<TensorRef>& refs, const AdamHyper& h) override {
    if (!refs.empty()) ok(cuda::adam(refs.data(), refs.size(), h, stream_));
  }
  void lamb(const std::vector<TensorRef>& refs, const LambHyper& h, double lr, double min_coeff,
            double max_coeff) override {
    if (refs.empty()) return;
    ok(cuda::lamb(refs.data(), refs.size(), h, static_cast<float>(lr),
                  static_cast<float>(min_coeff), static_cast<float>(max_coeff), stream_));
  }

 protected:
  static void ok(const std::string& e) {
    if (!e.empty()) throw loom::sdk::Error(LOOM_ERR_INTERNAL, e);
  }
  void* stream_ = nullptr;

 private:
  cuda::StreamOrder order_;
  int device_ = 0;
};
using CudaBackend = CudaBackendT<>;

// The two implementations of Backend, chosen per step by its tensors' device (all CPU or
// all CUDA: collect() refused a mix). Use as
//   Backend& be = backends_.begin(groups, args.stream);
//   StepBackend::End end(backends_);  // end() on a throw
//   ... be.adam(...) ...
//   end.done();                       // end(): the step's work is marked on its stream
class StepBackend {
 public:
  Backend& begin(const std::vector<StepGroup>& groups, void* stream) {
    const DLDevice d = step_device_of(groups);
    if (loom::sdk::is_cuda(d)) {
      cuda_.begin(stream, d.device_id);
      active_ = &cuda_;
      return cuda_;
    }
    active_ = nullptr;
    return cpu_;
  }
  void end() {
    if (active_ != nullptr) {
      active_ = nullptr;
      cuda_.end();
    }
  }

  // The host waits for the last CUDA step's work (before copying state on another stream).
  void synchronize() { cuda_.synchronize(); }

  // Calls end() when a step leaves its scope by an exception (done() on success).
  class End {
   public:
    explicit End(StepBackend& b) : b_(b) {}
    ~End() {
      if (!done_) {
        try {
          b_.end();
        } catch (...) {  // the step's own error is the one reported
        }
      }
    }
    End(const End&) = delete;
    End& operator=(const End&) = delete;
    void done() {
      done_ = true;
      b_.end();
    }

   private:
    StepBackend& b_;
    bool done_ = false;
  };

 private:
  CpuBackend cpu_;
  CudaBackend cuda_;
  CudaBackend* active_ = nullptr;  // the step's, when on CUDA
};

}  // namespace loom::optim
