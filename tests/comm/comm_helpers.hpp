// Helpers of the transport tests (comm_test.cpp, split_test.cpp, nonblocking_test.cpp,
// mpi_test.cpp): typed host buffers with DLTensor views, the tests' own fp16/bf16
// conversions, and the collectives of a comm instance as calls returning a Result.
//
// The same tests run against each host-memory transport: LOOM_TEST_COMM_PLUGIN names the
// plugin (ctest sets it to "mpi" for the comm.mpi.* entries; unset: "ucx").
#pragma once

#include <loom/embed.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace loom_test {

// The transport under test.
inline std::string transport() {
  const char* v = std::getenv("LOOM_TEST_COMM_PLUGIN");
  return v != nullptr && *v != '\0' ? v : "ucx";
}
inline bool testing_ucx() { return transport() == "ucx"; }

// ---- dtypes, written independently of the plugin's conversions

inline uint16_t to_bf16(float f) {  // exact for the small integers (and halves) the tests use
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
}
inline float from_bf16(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// fp16 for values that are exactly representable (|x| < 2048 with few mantissa bits) or
// rounded with the same rule as the reference below.
inline uint16_t to_f16(float f) {
  if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
  const uint16_t sign = f < 0 ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  int e = 0;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  // normal half: a = (1 + k/1024) * 2^(e-1), exponent field e - 1 + 15
  double k = std::nearbyint((m * 2.0 - 1.0) * 1024.0);
  int ef = e - 1 + 15;
  if (k == 1024.0) {
    k = 0;
    ++ef;
  }
  return static_cast<uint16_t>(sign | (ef << 10) | static_cast<int>(k));
}
inline float from_f16(uint16_t h) {
  const int ef = (h >> 10) & 0x1f;
  const int k = h & 0x3ff;
  const double v =
      ef == 0 ? k * std::ldexp(1.0, -24) : (1.0 + k / 1024.0) * std::ldexp(1.0, ef - 15);
  return static_cast<float>((h & 0x8000) != 0 ? -v : v);
}

enum class Dt { kF32, kF16, kBF16 };
inline const char* dt_name(Dt d) { return d == Dt::kF32 ? "f32" : d == Dt::kF16 ? "f16" : "bf16"; }
inline DLDataType dl(Dt d) {
  if (d == Dt::kF32) return DLDataType{kDLFloat, 32, 1};
  if (d == Dt::kF16) return DLDataType{kDLFloat, 16, 1};
  return DLDataType{kDLBfloat, 16, 1};
}
inline std::size_t esize(Dt d) { return d == Dt::kF32 ? 4 : 2; }
// Rounds a float to the dtype, as the reference does once at the end.
inline float round_to(Dt d, float v) {
  if (d == Dt::kF32) return v;
  if (d == Dt::kF16) return from_f16(to_f16(v));
  // bf16, round to nearest even
  uint32_t x = std::bit_cast<uint32_t>(v);
  x = (x + 0x7fff + ((x >> 16) & 1)) & 0xffff0000U;
  return std::bit_cast<float>(x);
}

// A typed host buffer with a DLTensor view.
struct Buf {
  Buf(Dt d, std::size_t n) : dt(d), bytes(n * esize(d)), shape(static_cast<int64_t>(n)) {
    t.data = bytes.empty() ? nullptr : bytes.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = dl(d);
    t.shape = &shape;
    t.strides = nullptr;
    t.byte_offset = 0;
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  std::size_t size() const { return static_cast<std::size_t>(shape); }
  void set(std::size_t i, float v) {
    if (dt == Dt::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dt == Dt::kF16 ? to_f16(v) : to_bf16(v);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  float get(std::size_t i) const {
    if (dt == Dt::kF32) {
      float v = 0;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      return v;
    }
    uint16_t h = 0;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return dt == Dt::kF16 ? from_f16(h) : from_bf16(h);
  }
  Dt dt;
  std::vector<unsigned char> bytes;
  int64_t shape;
  DLTensor t{};
};

// Small integers, exact in every dtype and in every partial sum.
inline float value(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 3) % 11) -
                            5);
}

inline std::string message(loom_status* st) {
  std::string m = st != nullptr && st->message != nullptr ? st->message : "";
  return m;
}

// Owns a status and exposes its code and message.
struct Result {
  explicit Result(loom_status* st) : code(st == nullptr ? LOOM_OK : st->code), text(message(st)) {
    if (st != nullptr) st->destroy(st);
  }
  int32_t code;
  std::string text;
};

// A comm instance's object and table, with the collectives as calls that return a Result:
// the instance a session declares (Comm below) or a sub-communicator split from it.
class CommView {
 public:
  CommView() = default;
  CommView(void* o, const loom_comm_v1* v) : obj(o), vt(v) {
    if (vt != nullptr) {
      rank = vt->rank(obj);
      size = vt->size(obj);
    }
  }
  // From an instance handle (e.g. what loom_comm_split returned).
  explicit CommView(const loom_instance* inst)
      : CommView(loom_instance_object(inst),
                 static_cast<const loom_comm_v1*>(loom_instance_vtable(inst))) {}

  Result allreduce(int32_t op, const DLTensor* send, DLTensor* recv) const {
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, op, send, recv, nullptr};
    return Result(vt->allreduce(obj, &a));
  }
  Result allgather(const DLTensor* send, DLTensor* recv) const {
    loom_allgather_args a{LOOM_ALLGATHER_ARGS_SIZE, 0, send, recv, nullptr};
    return Result(vt->allgather(obj, &a));
  }
  Result all_to_all(const DLTensor* send, DLTensor* recv, const int64_t* sc,
                    const int64_t* rc_) const {
    loom_all_to_all_args a{LOOM_ALL_TO_ALL_ARGS_SIZE, 0, send, recv, sc, rc_, nullptr};
    return Result(vt->all_to_all(obj, &a));
  }
  Result broadcast(int root, DLTensor* t) const {
    loom_broadcast_args a{LOOM_BROADCAST_ARGS_SIZE, root, t, nullptr};
    return Result(vt->broadcast(obj, &a));
  }
  Result barrier() const { return Result(vt->barrier(obj, nullptr)); }
  loom_comm_stats stats() const {
    loom_comm_stats s{};
    s.struct_size = LOOM_COMM_STATS_SIZE;
    Result r(vt->stats(obj, &s));
    EXPECT_EQ(r.code, LOOM_OK) << r.text;
    return s;
  }
  // Every rank's value of x, through the transport itself.
  std::vector<int64_t> gather(int64_t x) const {
    int64_t one = 1;
    int64_t many = size;
    DLTensor s{&x, {kDLCPU, 0}, 1, {kDLInt, 64, 1}, &one, nullptr, 0};
    std::vector<int64_t> all(static_cast<std::size_t>(size));
    DLTensor r{all.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, &many, nullptr, 0};
    Result res = allgather(&s, &r);
    EXPECT_EQ(res.code, LOOM_OK) << res.text;
    return all;
  }

  void* obj = nullptr;
  const loom_comm_v1* vt = nullptr;
  int rank = 0;
  int size = 1;
};

// One opened session with an instance of the transport under test named "world". `params`
// are the ucx transport's (timeouts, algorithm choices); other transports get none.
class Comm : public CommView {
 public:
  explicit Comm(const std::string& params = "") {
    const std::string toml =
        "[comm.world]\nplugin = \"" + transport() + "\"\n" + (testing_ucx() ? params : "");
    rc = loom_open_string(toml.c_str(), nullptr, nullptr, &session);
    if (rc != LOOM_OK) {
      error = loom_last_error();
      return;
    }
    rc = loom_find_instance(session, "comm", "world", &instance);
    if (rc != LOOM_OK) return;
    static_cast<CommView&>(*this) = CommView(instance);
  }
  ~Comm() { loom_close(session); }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  loom_session* session = nullptr;
  loom_instance* instance = nullptr;
  int32_t rc = LOOM_OK;
  std::string error;
};

}  // namespace loom_test
