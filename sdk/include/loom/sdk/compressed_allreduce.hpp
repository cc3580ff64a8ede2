// The compressed allreduce, written once over any loom.comm transport and any loom.codec
// codec: the two-phase error-feedback algorithm of 1-bit Adam (Tang et al., 2021, as
// DeepSpeed implements it), which averages a tensor across the ranks at about 1/32 of fp32's wire
// volume with the onebit codec.
//
// Each call, on rank r of n (padded length N from the codec's layout, chunk c = N / n):
//   1. worker:  encode(pad(x), worker_error) into n chunks (the codec adds the error and
//               stores the new residual), one chunk per destination rank;
//   2. phase 1: all_to_all of the chunks (as bytes): rank r receives chunk r of every rank;
//   3. server:  decode those n chunks with alpha = 1/n, summed in rank order, into its
//               slice (c elements; one pass with the codec's optional decode_sum), then
//               encode(slice, server_error) as one chunk;
//   4. phase 2: allgather of the n server chunks;
//   5. decode the n gathered chunks into the padded output; the first numel elements are
//      the result.
// Every rank decodes the same bytes in the same order, so the result is bit-identical on
// every rank. The error buffers stay rank-private; export them for checkpoints.
//
// Pipelined (Options::segment_elements > 0): the buffer is cut into segments of that many
// elements (rounded up to the codec's granularity), each averaged as above with its own
// chunks and scales. On a transport with non-blocking collectives (ABI 1.6) the exchanges
// run in the background in start order: every segment's phase 1 while this thread encodes
// the next, then each segment's server step and phase 2, the decode of one while the next
// one's allgather is in flight. One segment (0, the default) is the
// algorithm above exactly, DeepSpeed's numerics; more segments mean more scales (one per chunk
// of each segment), so other bits. Device memory runs the segments one after another on the
// stream.
//
// Usage (in an optimizer plugin holding `comm` and `codec` references):
//
//   #include <loom/sdk/compressed_allreduce.hpp>
//
//   auto comm = ctx.get_ref<loom_comm_v1>("comm");
//   auto codec = ctx.get_ref<loom_codec_v1>("codec");
//   // Collective: every rank constructs it with the same numel.
//   loom::sdk::CompressedAllreduce allreduce(ctx, comm, codec, numel);
//   ...
//   // In place: momentum becomes the compressed average over all ranks.
//   allreduce.run(momentum_tensor);      // fp32, contiguous, numel elements, host memory
//   auto t = allreduce.last_traffic();   // bytes this rank sent/received, rounds
//   // Or only this rank's slice of the average (steps 1-3 without the server's re-encode):
//   allreduce.reduce_scatter(gradient_tensor, slice_tensor);  // chunk_numel() elements
//   // and every rank's slice to every rank (steps 3-5: re-encode, allgather, decode):
//   allreduce.allgather(slice_tensor, update_tensor);  // numel() elements
//   ...
//   allreduce.export_state(writer);      // inside the optimizer's export_state
//   allreduce.import_state(reader);      // inside its import_state
//
// CUDA tensors: pass Options{.device = {kDLCUDA, id}, .stream = s, .device_ops = ops} where
// ops wraps cudaMemcpyAsync / cudaMemsetAsync (the header itself does not link CUDA); the
// codec and the transport must both support the device (checked at construction). Define
// LOOM_SDK_CUDA_RUNTIME before including this header to get those ops from
// <cuda_runtime_api.h> by default (then link CUDA::cudart).
//
// Streams (docs/abi.md): the buffers live across calls, so each call that queues work on
// them records an event on its stream at the end, and a call on another stream first makes
// its stream wait for that event (DeviceOps record_event / wait_event; without those a
// stream change is refused with FAILED_PRECONDITION). Export, import and reset use the
// last call's stream, and the destructor frees the buffers on it (stream-ordered, through
// the host's device_free): that stream must stay valid until the object is destroyed or
// used on another stream.
//
// Threads: one call at a time ([instance] of the comm and codec instances it uses).
#ifndef LOOM_SDK_COMPRESSED_ALLREDUCE_HPP
#define LOOM_SDK_COMPRESSED_ALLREDUCE_HPP

#include <loom/abi.h>
#include <loom/kinds/codec.h>
#include <loom/kinds/comm.h>
#include <loom/sdk/comm.hpp>
#include <loom/sdk/context.hpp>
#include <loom/sdk/device_ops.hpp>
#include <loom/sdk/state.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace loom::sdk {

// Traffic counters, read from the transport's stats before and after a call.
struct CompressedAllreduceTraffic {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t rounds = 0;   // collective calls the transport counted
  uint64_t wait_ns = 0;  // time blocked in the transport's calls (not encoding or decoding)
};

// Where a CompressedAllreduce works (CompressedAllreduce::Options).
struct CompressedAllreduceOptions {
  DLDevice device{kDLCPU, 0};  // where the tensors and every buffer live
  void* stream = nullptr;      // the allocation stream, and the first run()'s default stream
  DeviceOps device_ops;        // required unless device is host memory
  // > 0: pipelined in segments of this many elements (rounded up to the codec's unit);
  // 0: one segment.
  int64_t segment_elements = 0;
};

class CompressedAllreduce {
 public:
  using Options = CompressedAllreduceOptions;

  // Buffers from the host's allocators (Context::host_alloc / device_alloc). Collective: every
  // rank constructs with the same numel (checked over the transport when it supports host
  // memory; a mismatch is INVALID_ARGUMENT on every rank).
  CompressedAllreduce(const Context& ctx, InstanceRef<loom_comm_v1> comm,
                      InstanceRef<loom_codec_v1> codec, int64_t numel, Options options = {})
      : CompressedAllreduce(std::move(comm), std::move(codec), numel, std::move(options),
                            make_context_allocator(ctx)) {}

  // Without a Context (trainers, tests, benchmarks): host memory from operator new. Device
  // memory needs the Context constructor.
  CompressedAllreduce(InstanceRef<loom_comm_v1> comm, InstanceRef<loom_codec_v1> codec,
                      int64_t numel, Options options = {})
      : CompressedAllreduce(std::move(comm), std::move(codec), numel, std::move(options),
                            Allocator{}) {}

  CompressedAllreduce(const CompressedAllreduce&) = delete;
  CompressedAllreduce& operator=(const CompressedAllreduce&) = delete;
  ~CompressedAllreduce() {
    abandon();
    release();
  }

  // output = compressed average over ranks of input. Both fp32, contiguous, numel() elements,
  // on options.device; output may be input (in place). `stream`: NULL uses the last call's
  // stream (at first options.stream); another stream waits for the last call's work first.
  void run(const DLTensor& input, DLTensor& output, void* stream = nullptr) {
    begin(input, output, stream);
    end();
  }
  // In place.
  void run(DLTensor& tensor, void* stream = nullptr) { run(tensor, tensor, stream); }

  // Incremental: run() a segment at a time, each started once its elements are final, so the
  // exchange overlaps the caller's work (a backward that finishes the gradients from the last
  // layer down):
  //   begin(input, output, stream)  as run(), but sends nothing yet;
  //   start(k)  segment k's elements (segment_offset(k), segment_elements(k)) of `input` are
  //             final: encode them and start their phase 1 (it never blocks);
  //   end()     starts the segments not started yet (in ascending order), then in start order
  //             each one's server step and phase 2, decoding each while the next's is in flight;
  //             `output` holds the average;
  //   cancel()  drops the run instead (an undoable one's started segments get their errors
  //             back).
  // Each segment's result does not depend on when it starts, so any start order gives run()'s
  // bits; every rank must start the segments in the same order (they are collectives).
  // `undoable`: the error buffers are kept as they were at begin() until the next begin(), so
  // undo() after end() can put them back (an optimizer that skips the step; costs a copy of
  // each segment's errors and one more buffer of error_bytes()). Host or device memory; the
  // overlap needs host memory and a transport with non-blocking collectives (else each start()
  // runs its segment to the end). An exception leaves the run abandoned: begin() starts anew.
  void begin(const DLTensor& input, DLTensor& output, void* stream = nullptr,
             bool undoable = false) {
    if (stream == nullptr) stream = stream_;
    check_tensor(input, "compressed allreduce input");
    check_tensor(output, "compressed allreduce output");
    abandon();
    use_stream(stream);
    if (undoable && undo_ == nullptr) undo_ = allocate(error_bytes());
    run_ = std::make_unique<Run>();
    Run& r = *run_;
    r.in = data_as<const float>(input);
    r.out = data_as<float>(output);
    r.stream = stream;
    r.undoable = undoable;
    r.x = std::vector<Exchange>(segments_.size());
    r.started.assign(segments_.size(), false);
    r.pipelined = segments_.size() > 1 && is_cpu(options_.device) && comm_nonblocking(comm_);
    r.before = read_stats();
    run_wait_ns_ = 0;
  }
  void start(std::size_t k) {
    if (!run_ || k >= segments_.size() || run_->started[k]) {
      throw Error(
          LOOM_ERR_FAILED_PRECONDITION,
          "compressed allreduce: start(" + std::to_string(k) + ") " +
              (!run_                   ? "without begin()"
               : k >= segments_.size() ? "of " + std::to_string(segments_.size()) + " segments"
                                       : "twice in one run"));
    }
    Run& r = *run_;
    const Marker marker(*this);
    try {
      r.started[k] = true;
      if (r.undoable) keep_errors(k, r.stream);
      worker(k, source(k), r.x[k], r.stream, r.pipelined);
      if (!r.pipelined) {
        server(k, r.x[k], r.stream, false);
        finish_into(k);
        return;
      }
      r.order.push_back(k);  // the server step waits for end(): start() never blocks
    } catch (...) {
      abandon();
      throw;
    }
  }
  void end() {
    if (!run_)
      throw Error(LOOM_ERR_FAILED_PRECONDITION, "compressed allreduce: end() without begin()");
    for (std::size_t k = 0; k < segments_.size(); ++k) {
      if (!run_->started[k]) start(k);
    }
    Run& r = *run_;
    const Marker marker(*this);
    try {
      // Every rank starts the allgathers in the same order, after all the all_to_alls;
      // segment i's decode runs while segment i + 1's allgather is in flight.
      const std::size_t count = r.order.size();
      for (std::size_t i = 0; i < count; ++i) {
        server(r.order[i], r.x[r.order[i]], r.stream, true);
        if (i >= 1) finish_into(r.order[i - 1]);
      }
      if (count >= 1) finish_into(r.order[count - 1]);
    } catch (...) {
      abandon();
      throw;
    }
    account(r.before);
    run_kept_ = r.undoable;
    run_.reset();
  }
  // Drops a run in progress (after an error elsewhere): waits for the exchanges it started
  // and, when undoable, puts back the errors of the segments it started. No-op without one.
  void cancel() {
    if (!run_) return;
    const bool restore = run_->undoable;
    std::vector<bool> started = run_->started;
    abandon();
    if (!restore) return;
    for (std::size_t k = 0; k < started.size(); ++k) {
      if (started[k]) restore_errors(k, stream_);
    }
    mark();
  }
  void undo() {
    if (run_ || !run_kept_) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "compressed allreduce: undo() needs a finished undoable run");
    }
    copy(worker_error_, undo_, worker_bytes(), stream_);
    copy(server_error_, static_cast<unsigned char*>(undo_) + worker_bytes(), server_bytes(),
         stream_);
    run_kept_ = false;
    mark();
  }

  // The first half of run(), for owners that keep one slice of the result each (a sharded
  // optimizer): `slice` = this rank's chunk_numel() elements of the compressed average of
  // `input`, elements [rank() * c, rank() * c + c) of the padded buffer (c = chunk_numel();
  // the padding's entries average zeros). Only the worker half compresses (the worker error
  // is updated, the server error is not used), so the slice is the exact average of the ranks'
  // decoded encodings, about half run()'s bytes. One segment only (segment_elements = 0).
  void reduce_scatter(const DLTensor& input, DLTensor& slice, void* stream = nullptr) {
    if (stream == nullptr) stream = stream_;
    check_tensor(input, "compressed reduce-scatter input");
    check_tensor(slice, "compressed reduce-scatter slice", chunk_numel());
    one_segment("reduce-scatter");
    use_stream(stream);
    const Marker marker(*this);
    const CompressedAllreduceTraffic before = read_stats();
    run_wait_ns_ = 0;
    const float* src = data_as<const float>(input);
    if (padded_ != numel_) {
      copy(work_, src, static_cast<std::size_t>(numel_) * sizeof(float), stream);
      src = static_cast<const float*>(work_);
    }
    Exchange x;
    worker(0, src, x, stream, /*pipelined=*/false);
    reduce(0, x, slice, stream);
    account(before);
  }

  // The second half of run(): `output` (numel() elements) = every rank's `slice`
  // (chunk_numel() elements: rank r's covers [r * c, r * c + c) of the padded buffer), each
  // encoded with its rank's server error (updated), allgathered and decoded, so every rank
  // gets the same bits. For an owner that updated its slice alone and shares the change (a
  // sharded optimizer's parameter update); about half run()'s bytes. One segment only.
  void allgather(const DLTensor& slice, DLTensor& output, void* stream = nullptr) {
    if (stream == nullptr) stream = stream_;
    check_tensor(slice, "compressed allgather slice", chunk_numel());
    check_tensor(output, "compressed allgather output");
    one_segment("allgather");
    use_stream(stream);
    const Marker marker(*this);
    const CompressedAllreduceTraffic before = read_stats();
    run_wait_ns_ = 0;
    Segment& g = segments_[0];
    Exchange x;
    x.recv = bytes_tensor(recv_, &g.shape_all);
    share(0, x, slice, stream, /*pipelined=*/false);
    float* out = data_as<float>(output);
    const bool direct = padded_ == numel_;
    finish(0, direct ? out : static_cast<float*>(work_), x, stream);
    if (!direct) {
      copy(out, work_, static_cast<std::size_t>(numel_) * sizeof(float), stream);
      zero(static_cast<float*>(work_) + numel_,
           static_cast<std::size_t>(padded_ - numel_) * sizeof(float), stream);
    }
    account(before);
  }

  // Makes `stream` the one later work on the buffers goes to (run() without a stream, reset,
  // export, import, the destructor's frees), ordered after the work queued so far: for an
  // owner that also touches the buffers itself (worker_error(), server_error()) on its own
  // stream. No-op for host memory and for the current stream.
  void use_stream(void* stream) {
    if (is_cpu(options_.device) || stream == stream_) return;
    if (!options_.device_ops.record_event || !options_.device_ops.wait_event) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "compressed allreduce on " + device_string(options_.device) +
                      ": a call on another stream than the last one needs "
                      "Options::device_ops.record_event and wait_event");
    }
    if (event_ != nullptr) options_.device_ops.wait_event(event_, stream);
    stream_ = stream;
    mark();  // the event follows the new stream (the old one may go away)
  }
  // The stream later work goes to (the last call's).
  void* stream() const { return stream_; }

  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return padded_; }         // N
  int64_t chunk_numel() const { return padded_ / size_; }  // c = N / n (one segment)
  // Segments (1 unless Options::segment_elements cut the buffer) and their length (the last
  // may be shorter).
  std::size_t segment_count() const { return segments_.size(); }
  int64_t segment_numel() const { return segments_.front().padded; }
  // Segment k's elements of the input: [segment_offset(k), + segment_elements(k)).
  int64_t segment_offset(std::size_t k) const { return segments_.at(k).offset; }
  int64_t segment_elements(std::size_t k) const {
    const Segment& g = segments_.at(k);
    return std::min(g.padded, numel_ - g.offset);
  }
  std::size_t chunk_bytes() const { return chunk_bytes_; }
  int32_t rank() const { return rank_; }
  int32_t world_size() const { return size_; }
  const Options& options() const { return options_; }

  // The error-feedback buffers (fp32, on options.device): worker [N], server [N / n].
  // Borrowed views; valid while this object lives.
  DLTensor worker_error() const { return tensor(worker_error_, &shape_padded_); }
  DLTensor server_error() const { return tensor(server_error_, &shape_chunk_); }

  // Both error buffers as bytes (worker then server, native fp32), e.g. for a checkpoint.
  std::vector<std::byte> export_errors() const {
    std::vector<std::byte> out(error_bytes());
    to_host(out.data(), worker_error_, worker_bytes());
    to_host(out.data() + worker_bytes(), server_error_, server_bytes());
    return out;
  }
  // Restores what export_errors returned; a blob of another size is INVALID_ARGUMENT and
  // changes nothing.
  void import_errors(std::span<const std::byte> blob) {
    if (blob.size() != error_bytes()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "compressed allreduce error state has " + std::to_string(blob.size()) +
                      " bytes, expected " + std::to_string(error_bytes()) + " (padded length " +
                      std::to_string(padded_) + ", " + std::to_string(size_) + " ranks)");
    }
    from_host(worker_error_, blob.data(), worker_bytes());
    from_host(server_error_, blob.data() + worker_bytes(), server_bytes());
  }

  // Versioned state for an owner's export_state/import_state: header, numel, padded length,
  // world size, then the errors. import_state checks all three sizes against this object.
  void export_state(StateWriter& out) const {
    out.write_header(kStateMagic, kStateVersion);
    out.write_pod<int64_t>(numel_);
    out.write_pod<int64_t>(padded_);
    out.write_pod<int32_t>(size_);
    out.write_pod<int64_t>(segment_numel());
    const std::vector<std::byte> errors = export_errors();
    out.write_pod<uint64_t>(errors.size());
    out.write(errors.data(), errors.size());
  }
  void import_state(StateReader& in) {
    const uint32_t version = in.read_header(kStateMagic, kStateVersion);
    const auto numel = in.read_pod<int64_t>();
    const auto padded = in.read_pod<int64_t>();
    const auto size = in.read_pod<int32_t>();
    // Version 1 had one segment. The server errors are laid out by segment, so another
    // segmentation cannot take them.
    const int64_t segment = version >= 2 ? in.read_pod<int64_t>() : padded;
    if (segment != segment_numel()) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "compressed allreduce state was written with segments of " +
                      std::to_string(segment) + " elements; this one has " +
                      std::to_string(segment_numel()) +
                      " (set the same segment length to resume from it)");
    }
    if (numel != numel_ || padded != padded_ || size != size_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "compressed allreduce state is for " + std::to_string(numel) + " elements (" +
                      std::to_string(padded) + " padded) on " + std::to_string(size) +
                      " ranks; this one has " + std::to_string(numel_) + " (" +
                      std::to_string(padded_) + ") on " + std::to_string(size_));
    }
    const auto bytes = in.read_pod<uint64_t>();
    if (bytes != error_bytes()) throw Error(LOOM_ERR_DATA_LOSS, "corrupt error state size");
    import_errors(in.read_bytes(static_cast<std::size_t>(bytes)));
  }

  // Zeroes both error buffers (a fresh start, as at construction), on the last call's stream.
  void reset() {
    zero(worker_error_, worker_bytes(), stream_);
    zero(server_error_, server_bytes(), stream_);
    mark();
  }

  // Traffic of the last run() and of all runs so far, and the number of runs.
  CompressedAllreduceTraffic last_traffic() const { return last_; }
  CompressedAllreduceTraffic total_traffic() const { return total_; }
  uint64_t calls() const { return calls_; }

 private:
  // Records the event after the work queued on the current stream (device memory with
  // record_event only).
  void mark() {
    if (!is_cpu(options_.device) && options_.device_ops.record_event) {
      options_.device_ops.record_event(&event_, stream_);
    }
  }
  // Calls mark() when a run() leaves, returning or throwing (work may have been queued).
  struct Marker {
    explicit Marker(CompressedAllreduce& c) : owner(c) {}
    ~Marker() {
      try {
        owner.mark();
      } catch (...) {  // a failure to record shows at the next wait or sync
      }
    }
    Marker(const Marker&) = delete;
    Marker& operator=(const Marker&) = delete;
    CompressedAllreduce& owner;
  };

  // Segment k of the padded buffer: elements [offset, offset + padded), chunks of padded / n
  // elements encoding to chunk_bytes each; its server slice starts at server_offset of the
  // server error, its encodings at bytes (n chunks each in send_ and recv_, one in
  // server_chunk_ at chunk_offset).
  struct Segment {
    int64_t offset = 0;
    int64_t padded = 0;
    std::size_t chunk_bytes = 0;
    int64_t server_offset = 0;
    std::size_t bytes = 0;
    std::size_t chunk_offset = 0;
    // DLTensor shapes point here.
    int64_t shape_padded = 0;
    int64_t shape_chunk = 0;
    int64_t shape_one = 0;
    int64_t shape_all = 0;
  };
  // One segment's exchanges of one run: their args and tensors live until they are waited for.
  struct Exchange {
    DLTensor send{};
    DLTensor recv{};
    DLTensor chunk{};
    loom_all_to_all_args a2a{};
    loom_allgather_args ag{};
    CommRequest request;
  };

  // The run begin() started: its buffers, the segments' exchanges and the order they started.
  struct Run {
    const float* in = nullptr;
    float* out = nullptr;
    void* stream = nullptr;
    bool undoable = false;
    bool pipelined = false;
    std::vector<Exchange> x;  // sized once: the args point into it
    std::vector<bool> started;
    std::vector<std::size_t> order;
    CompressedAllreduceTraffic before;
  };

  // Segment k's input as the worker reads it at its offset: the caller's buffer, or work_ for
  // the segment the codec pads past numel() (its tail stays zero).
  const float* source(std::size_t k) {
    const Segment& g = segments_[k];
    if (g.offset + g.padded <= numel_) return run_->in;
    copy(static_cast<float*>(work_) + g.offset, run_->in + g.offset,
         static_cast<std::size_t>(numel_ - g.offset) * sizeof(float), run_->stream);
    return static_cast<const float*>(work_);
  }
  // finish() into the caller's output (through work_ for the padded segment).
  void finish_into(std::size_t k) {
    const Segment& g = segments_[k];
    Run& r = *run_;
    if (g.offset + g.padded <= numel_) {
      finish(k, r.out, r.x[k], r.stream);
      return;
    }
    auto* work = static_cast<float*>(work_);
    finish(k, work, r.x[k], r.stream);
    copy(r.out + g.offset, work + g.offset,
         static_cast<std::size_t>(numel_ - g.offset) * sizeof(float), r.stream);
    zero(work + numel_, static_cast<std::size_t>(padded_ - numel_) * sizeof(float), r.stream);
  }
  // Keeps segment k's worker and server errors in undo_ (same layout) before they change.
  void keep_errors(std::size_t k, void* stream) {
    const Segment& g = segments_[k];
    const auto f = sizeof(float);
    copy(static_cast<unsigned char*>(undo_) + static_cast<std::size_t>(g.offset) * f,
         static_cast<float*>(worker_error_) + g.offset, static_cast<std::size_t>(g.padded) * f,
         stream);
    copy(static_cast<unsigned char*>(undo_) + worker_bytes() +
             static_cast<std::size_t>(g.server_offset) * f,
         static_cast<float*>(server_error_) + g.server_offset,
         static_cast<std::size_t>(g.padded / size_) * f, stream);
  }
  // Segment k's errors back from undo_ (keep_errors' inverse).
  void restore_errors(std::size_t k, void* stream) {
    const Segment& g = segments_[k];
    const auto f = sizeof(float);
    copy(static_cast<float*>(worker_error_) + g.offset,
         static_cast<unsigned char*>(undo_) + static_cast<std::size_t>(g.offset) * f,
         static_cast<std::size_t>(g.padded) * f, stream);
    copy(static_cast<float*>(server_error_) + g.server_offset,
         static_cast<unsigned char*>(undo_) + worker_bytes() +
             static_cast<std::size_t>(g.server_offset) * f,
         static_cast<std::size_t>(g.padded / size_) * f, stream);
  }
  // Drops a run in progress: waits for the exchanges it started (their buffers are ours).
  void abandon() noexcept {
    if (run_) {
      for (Exchange& x : run_->x) {
        try {
          x.request.wait();
        } catch (...) {  // the run's own error is the one reported
        }
      }
    }
    run_.reset();
    run_kept_ = false;
  }

  // Starts (pipelined) or runs one exchange.
  void exchange(Exchange& x, loom_comm_collective which, const void* args, bool pipelined) {
    if (pipelined) {
      x.request = comm_start(comm_, which, args);
    } else if (which == LOOM_COLLECTIVE_ALL_TO_ALL) {
      blocked([&] {
        comm_.call(&loom_comm_v1::all_to_all, static_cast<const loom_all_to_all_args*>(args));
      });
    } else {
      blocked([&] {
        comm_.call(&loom_comm_v1::allgather, static_cast<const loom_allgather_args*>(args));
      });
    }
  }
  // Runs fn, counting its time as time blocked in the transport.
  template <class Fn>
  void blocked(Fn&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    run_wait_ns_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }

  // Encodes segment k (+ its worker error) into n chunks and starts phase 1: chunk i to rank i.
  void worker(std::size_t k, const float* src, Exchange& x, void* stream, bool pipelined) {
    Segment& g = segments_[k];
    DLTensor src_t = tensor(const_cast<float*>(src) + g.offset, &g.shape_padded);  // NOLINT
    DLTensor worker_e = tensor(static_cast<float*>(worker_error_) + g.offset, &g.shape_padded);
    void* send = static_cast<unsigned char*>(send_) + g.bytes;
    encode(&src_t, &worker_e, static_cast<uint32_t>(size_), send, stream);
    x.send = bytes_tensor(send, &g.shape_all);
    x.recv = bytes_tensor(static_cast<unsigned char*>(recv_) + g.bytes, &g.shape_all);
    x.a2a.struct_size = LOOM_ALL_TO_ALL_ARGS_SIZE;
    x.a2a.send = &x.send;
    x.a2a.recv = &x.recv;
    x.a2a.stream = stream;
    exchange(x, LOOM_COLLECTIVE_ALL_TO_ALL, &x.a2a, pipelined);
  }

  // Finishes phase 1 of segment k, averages the n received chunks of this rank's slice, adds
  // the server error, re-encodes it as one chunk and starts phase 2 (every rank gets every
  // server chunk, into the same receive buffer).
  void server(std::size_t k, Exchange& x, void* stream, bool pipelined) {
    Segment& g = segments_[k];
    DLTensor slice_t = tensor(slice_, &g.shape_chunk);
    reduce(k, x, slice_t, stream);
    share(k, x, slice_t, stream, pipelined);
  }

  // Encodes this rank's slice of segment k (+ the server error) as one chunk and starts
  // phase 2 into x.recv.
  void share(std::size_t k, Exchange& x, const DLTensor& slice, void* stream, bool pipelined) {
    Segment& g = segments_[k];
    DLTensor server_e =
        tensor(static_cast<float*>(server_error_) + g.server_offset, &g.shape_chunk);
    void* chunk = static_cast<unsigned char*>(server_chunk_) + g.chunk_offset;
    encode(&slice, &server_e, 1, chunk, stream);
    x.chunk = bytes_tensor(chunk, &g.shape_one);
    x.ag.struct_size = LOOM_ALLGATHER_ARGS_SIZE;
    x.ag.send = &x.chunk;
    x.ag.recv = &x.recv;
    x.ag.stream = stream;
    exchange(x, LOOM_COLLECTIVE_ALLGATHER, &x.ag, pipelined);
  }

  // Finishes phase 1 of segment k and averages the n received chunks of this rank's slice
  // into `out` (the segment's chunk length).
  void reduce(std::size_t k, Exchange& x, DLTensor& out, void* stream) {
    blocked([&] { x.request.wait(); });
    const Segment& g = segments_[k];
    // A codec with decode_sum sums the n chunks in one pass over the slice; otherwise each
    // chunk is decoded in turn, accumulating (the same result, bit for bit).
    const void* recv = x.recv.data;
    loom_codec_decode_args dec{};
    dec.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
    dec.output = &out;
    dec.alpha = 1.0f / static_cast<float>(size_);
    dec.stream = stream;
    if (codec_.provides(&loom_codec_v1::decode_sum)) {
      dec.chunk_count = static_cast<uint32_t>(size_);
      dec.input = recv;
      dec.accumulate = 0;
      codec_.call(&loom_codec_v1::decode_sum, &dec);
    } else {
      dec.chunk_count = 1;
      for (int32_t i = 0; i < size_; ++i) {
        dec.input =
            static_cast<const unsigned char*>(recv) + static_cast<std::size_t>(i) * g.chunk_bytes;
        dec.accumulate = i > 0 ? 1 : 0;
        codec_.call(&loom_codec_v1::decode, &dec);
      }
    }
  }

  // Finishes phase 2 of segment k and decodes the n gathered chunks into dst.
  void finish(std::size_t k, float* dst, Exchange& x, void* stream) {
    blocked([&] { x.request.wait(); });
    Segment& g = segments_[k];
    DLTensor out_t = tensor(dst + g.offset, &g.shape_padded);
    loom_codec_decode_args fin{};
    fin.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
    fin.chunk_count = static_cast<uint32_t>(size_);
    fin.input = x.recv.data;
    fin.output = &out_t;
    fin.alpha = 1.0f;
    fin.accumulate = 0;
    fin.stream = stream;
    codec_.call(&loom_codec_v1::decode, &fin);
  }

  // The codec's layout of `elements` over the ranks, checked.
  loom_codec_layout layout_of(uint64_t elements) const {
    loom_codec_layout layout{};
    layout.struct_size = LOOM_CODEC_LAYOUT_SIZE;
    layout.elements = elements;
    layout.world_size = size_;
    codec_.call(&loom_codec_v1::layout, &layout);
    if (layout.padded_elements < layout.elements ||
        layout.padded_elements % static_cast<uint64_t>(size_) != 0 || layout.chunk_bytes == 0 ||
        layout.padded_elements > static_cast<uint64_t>(INT64_MAX / 8)) {
      throw Error(LOOM_ERR_INTERNAL, "codec '" + codec_.name() + "' returned an invalid layout (" +
                                         std::to_string(layout.padded_elements) + " padded, " +
                                         std::to_string(layout.chunk_bytes) + " bytes a chunk)");
    }
    return layout;
  }

  // Cuts the buffer into segments: of options_.segment_elements rounded up to the codec's unit
  // (the padded length of one element), the last one padded alone; one segment when 0 or when
  // that covers the buffer.
  void plan_segments() {
    const loom_codec_layout whole = layout_of(static_cast<uint64_t>(numel_));
    int64_t seg = static_cast<int64_t>(whole.padded_elements);
    if (options_.segment_elements < 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "compressed allreduce: segment_elements must be 0 or more, got " +
                      std::to_string(options_.segment_elements));
    }
    if (options_.segment_elements > 0) {
      const auto unit = static_cast<int64_t>(layout_of(1).padded_elements);
      seg = (options_.segment_elements + unit - 1) / unit * unit;
      if (static_cast<int64_t>(layout_of(static_cast<uint64_t>(seg)).padded_elements) != seg) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "compressed allreduce: codec '" + codec_.name() + "' pads " +
                        std::to_string(seg) + " elements, so it cannot cut segments of " +
                        std::to_string(options_.segment_elements) + " elements");
      }
    }
    segments_.clear();
    int64_t at = 0;
    std::size_t bytes = 0;
    std::size_t chunk_at = 0;
    while (at < numel_) {
      const int64_t len = std::min(seg, numel_ - at);
      const loom_codec_layout l = len == numel_ ? whole : layout_of(static_cast<uint64_t>(len));
      Segment g;
      g.offset = at;
      g.padded = static_cast<int64_t>(l.padded_elements);
      g.chunk_bytes = static_cast<std::size_t>(l.chunk_bytes);
      g.server_offset = at / size_;
      g.bytes = bytes;
      g.chunk_offset = chunk_at;
      g.shape_padded = g.padded;
      g.shape_chunk = g.padded / size_;
      g.shape_one = static_cast<int64_t>(g.chunk_bytes);
      g.shape_all = static_cast<int64_t>(g.chunk_bytes) * size_;
      bytes += g.chunk_bytes * static_cast<std::size_t>(size_);
      chunk_at += g.chunk_bytes;
      segments_.push_back(g);
      at += g.padded;
    }
    padded_ = at;
    chunk_bytes_ = segments_.front().chunk_bytes;
    encoded_bytes_ = bytes;
    server_chunk_bytes_ = chunk_at;
  }

  // Encodes `input` (+ `error`, updated in place) into `chunks` chunks at `output`.
  void encode(const DLTensor* input, DLTensor* error, uint32_t chunks, void* output, void* stream) {
    loom_codec_encode_args enc{};
    enc.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
    enc.chunk_count = chunks;
    enc.input = input;
    enc.error = error;
    enc.output = output;
    enc.stream = stream;
    codec_.call(&loom_codec_v1::encode, &enc);
  }

  static constexpr const char* kStateMagic = "loom.compressed_allreduce";
  static constexpr uint32_t kStateVersion = 2;  // 2: with the segment length

  struct Allocator {
    std::function<void*(std::size_t)> alloc;  // empty: host memory from operator new
    std::function<void(void*)> free;
  };

  Allocator make_context_allocator(const Context& ctx) const {
    // The options are not known yet (delegating constructor); capture by value later.
    Allocator a;
    a.alloc = [ctx, this](std::size_t bytes) {
      return ctx.device_alloc(options_.device, bytes, stream_);
    };
    a.free = [ctx, this](void* p) noexcept {
      try {
        ctx.device_free(options_.device, p, stream_);
      } catch (...) {
      }
    };
    return a;
  }

  CompressedAllreduce(InstanceRef<loom_comm_v1> comm, InstanceRef<loom_codec_v1> codec,
                      int64_t numel, Options options, Allocator allocator)
      : comm_(std::move(comm)),
        codec_(std::move(codec)),
        options_(std::move(options)),
        allocator_(std::move(allocator)),
        numel_(numel),
        stream_(options_.stream) {
    if (!comm_) throw Error(LOOM_ERR_INVALID_ARGUMENT, "compressed allreduce: comm is not set");
    if (!codec_) throw Error(LOOM_ERR_INVALID_ARGUMENT, "compressed allreduce: codec is not set");
    if (numel_ <= 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "compressed allreduce: numel must be positive, got " + std::to_string(numel_));
    }
    const bool host = is_cpu(options_.device);
    if (!host && !allocator_.alloc) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "compressed allreduce on " + device_string(options_.device) +
                      " needs the Context constructor (device memory comes from the host)");
    }
    if (!host && (!options_.device_ops.copy || !options_.device_ops.zero ||
                  !options_.device_ops.to_host || !options_.device_ops.from_host)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "compressed allreduce on " +
                                                 device_string(options_.device) +
                                                 " needs Options::device_ops (copy, zero, "
                                                 "to_host, from_host)");
    }
    if (comm_.call(&loom_comm_v1::supports_device, options_.device) == 0) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, "transport '" + comm_.name() + "' cannot use " +
                                              device_string(options_.device) + " memory");
    }
    if (codec_.call(&loom_codec_v1::supports_device, options_.device) == 0) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, "codec '" + codec_.name() + "' cannot use " +
                                              device_string(options_.device) + " memory");
    }
    rank_ = comm_.call(&loom_comm_v1::rank);
    size_ = comm_.call(&loom_comm_v1::size);
    if (size_ <= 0 || rank_ < 0 || rank_ >= size_) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION, "transport '" + comm_.name() + "' reports rank " +
                                                    std::to_string(rank_) + " of " +
                                                    std::to_string(size_));
    }

    plan_segments();
    shape_padded_ = padded_;
    shape_chunk_ = padded_ / size_;

    if (host) check_same_numel();

    try {
      worker_error_ = allocate(worker_bytes());
      server_error_ = allocate(server_bytes());
      // The padded copy of the input (and output) only where the codec pads.
      if (padded_ != numel_) work_ = allocate(worker_bytes());
      slice_ = allocate(static_cast<std::size_t>(segments_.front().padded / size_) * sizeof(float));
      send_ = allocate(encoded_bytes_);
      recv_ = allocate(encoded_bytes_);
      server_chunk_ = allocate(server_chunk_bytes_);
      if (work_ != nullptr) zero(work_, worker_bytes(), stream_);
      reset();
    } catch (...) {
      release();
      throw;
    }
  }

  // Every rank must pass the same numel: exchange it once over the transport.
  void check_same_numel() {
    const std::vector<int64_t> all = comm_allgather_value(comm_, static_cast<int64_t>(numel_));
    for (int32_t i = 0; i < size_; ++i) {
      if (all[static_cast<std::size_t>(i)] != numel_) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "compressed allreduce: rank " + std::to_string(i) + " has " +
                        std::to_string(all[static_cast<std::size_t>(i)]) + " elements, rank " +
                        std::to_string(rank_) + " has " + std::to_string(numel_));
      }
    }
  }

  // fp32, contiguous, `n` elements (numel() unless given), on the options' device.
  void check_tensor(const DLTensor& t, const char* what, int64_t n = -1) const {
    expect_tensor(&t, what);
    expect_fp32(t, what);
    expect_contiguous(t, what);
    expect_numel(t, n < 0 ? numel_ : n, what);
    if (is_cpu(options_.device)) {
      expect_cpu(t, what);
    } else {
      expect_device(t, options_.device, what);
    }
  }

  // reduce_scatter() and allgather() work on one segment (segment_elements = 0).
  void one_segment(const char* what) const {
    if (segments_.size() != 1) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  std::string("compressed ") + what + " needs one segment; this allreduce has " +
                      std::to_string(segments_.size()) + " (segment_elements = 0)");
    }
  }

  // The traffic and waiting of the call that read `before` at its start: into last_ and total_.
  void account(const CompressedAllreduceTraffic& before) {
    const CompressedAllreduceTraffic after = read_stats();
    last_.bytes_sent = after.bytes_sent - before.bytes_sent;
    last_.bytes_received = after.bytes_received - before.bytes_received;
    last_.rounds = after.rounds - before.rounds;
    last_.wait_ns = run_wait_ns_;
    total_.wait_ns += last_.wait_ns;
    total_.bytes_sent += last_.bytes_sent;
    total_.bytes_received += last_.bytes_received;
    total_.rounds += last_.rounds;
    ++calls_;
  }

  CompressedAllreduceTraffic read_stats() const {
    loom_comm_stats s{};
    s.struct_size = LOOM_COMM_STATS_SIZE;
    comm_.call(&loom_comm_v1::stats, &s);
    return {s.bytes_sent, s.bytes_received, s.rounds};
  }

  DLTensor tensor(void* data, int64_t* shape) const {
    return flat_view(data, options_.device, DLDataType{kDLFloat, 32, 1}, shape);
  }
  DLTensor bytes_tensor(void* data, int64_t* shape) const {
    return flat_view(data, options_.device, DLDataType{kDLUInt, 8, 1}, shape);
  }

  std::size_t worker_bytes() const { return static_cast<std::size_t>(padded_) * sizeof(float); }
  std::size_t server_bytes() const {
    return static_cast<std::size_t>(padded_ / size_) * sizeof(float);
  }
  std::size_t error_bytes() const { return worker_bytes() + server_bytes(); }

  void* allocate(std::size_t bytes) {
    if (allocator_.alloc) return allocator_.alloc(bytes);
    return ::operator new (bytes, std::align_val_t{64});
  }
  void deallocate(void* p) noexcept {
    if (p == nullptr) return;
    if (allocator_.free) {
      allocator_.free(p);
    } else {
      ::operator delete (p, std::align_val_t{64});
    }
  }
  // Frees the buffers (stream-ordered) and the ordering event.
  void release() noexcept {
    for (void** p : {&worker_error_, &server_error_, &work_, &slice_, &send_, &recv_,
                     &server_chunk_, &undo_}) {
      deallocate(*p);
      *p = nullptr;
    }
    if (event_ != nullptr && options_.device_ops.destroy_event) {
      options_.device_ops.destroy_event(event_);
    }
    event_ = nullptr;
  }

  void copy(void* dst, const void* src, std::size_t bytes, void* stream) const {
    if (bytes == 0 || dst == src) return;
    if (is_cpu(options_.device)) {
      std::memcpy(dst, src, bytes);
    } else {
      options_.device_ops.copy(dst, src, bytes, stream);
    }
  }
  void zero(void* dst, std::size_t bytes, void* stream) const {
    if (bytes == 0) return;
    if (is_cpu(options_.device)) {
      std::memset(dst, 0, bytes);
    } else {
      options_.device_ops.zero(dst, bytes, stream);
    }
  }
  void to_host(void* dst, const void* src, std::size_t bytes) const {
    if (is_cpu(options_.device)) {
      std::memcpy(dst, src, bytes);
    } else {
      options_.device_ops.to_host(dst, src, bytes, stream_);
    }
  }
  void from_host(void* dst, const void* src, std::size_t bytes) const {
    if (is_cpu(options_.device)) {
      std::memcpy(dst, src, bytes);
    } else {
      options_.device_ops.from_host(dst, src, bytes, stream_);
    }
  }

  InstanceRef<loom_comm_v1> comm_;
  InstanceRef<loom_codec_v1> codec_;
  Options options_;
  Allocator allocator_;
  int64_t numel_ = 0;
  int64_t padded_ = 0;
  std::size_t chunk_bytes_ = 0;
  int32_t rank_ = 0;
  int32_t size_ = 1;
  // DLTensor shapes point here, so the object must not move (it is neither copyable nor
  // movable).
  mutable int64_t shape_padded_ = 0;
  mutable int64_t shape_chunk_ = 0;
  std::vector<Segment> segments_;
  std::size_t encoded_bytes_ = 0;       // n chunks of every segment
  std::size_t server_chunk_bytes_ = 0;  // one chunk of every segment
  void* worker_error_ = nullptr;        // fp32[N]
  void* server_error_ = nullptr;        // fp32[N / n]
  void* work_ = nullptr;                // fp32[N] where N > numel: padded input, then output
  void* slice_ = nullptr;               // fp32[a segment / n]: this rank's averaged slice
  void* send_ = nullptr;                // n chunks a segment: the worker's encodings
  void* recv_ = nullptr;                // n chunks a segment: phase 1's receive, then phase 2's
  void* server_chunk_ = nullptr;        // 1 chunk a segment: the server's encodings
  CompressedAllreduceTraffic last_;
  CompressedAllreduceTraffic total_;
  std::unique_ptr<Run> run_;  // begin() .. end()
  void* undo_ = nullptr;   // undoable runs: the errors at begin(), as worker_error_ + server_error_
  bool run_kept_ = false;  // undo_ holds the last (finished) run's errors
  uint64_t run_wait_ns_ = 0;  // the current run's time blocked in the transport
  uint64_t calls_ = 0;
  void* stream_ = nullptr;  // the last call's stream: later work and the frees go there
  void* event_ = nullptr;   // recorded after the last call's work on stream_ (device memory)
};

}  // namespace loom::sdk

#endif  // LOOM_SDK_COMPRESSED_ALLREDUCE_HPP
