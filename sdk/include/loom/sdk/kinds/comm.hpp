// The "loom.comm/1" kind in the SDK (loom/kinds/comm.h): the base class a transport derives
// from and the table the SDK builds from it. The helpers for code that calls a communicator
// (reduce_op_string, SubComm, the 1.2 calls) are in loom/sdk/comm.hpp, included here.
#ifndef LOOM_SDK_KINDS_COMM_HPP
#define LOOM_SDK_KINDS_COMM_HPP

#include <loom/kinds/comm.h>
#include <loom/sdk/collective_queue.hpp>
#include <loom/sdk/comm.hpp>
#include <loom/sdk/context.hpp>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/plugin.hpp>

#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace loom::sdk {

// "loom.comm/1"
//   required: int32_t rank(), int32_t size(), bool supports_device(DLDevice),
//             void allreduce(const loom_allreduce_args&),
//             void allgather(const loom_allgather_args&),
//             void all_to_all(const loom_all_to_all_args&),
//             void broadcast(const loom_broadcast_args&), void barrier(void* stream),
//             void stats(loom_comm_stats&)
//   optional: NativeHandle native_handle()
//             std::optional<S> split(int32_t color, int32_t key), with a constructor
//             T(Context&, S&&): split runs the collective over this instance and returns
//             what the sub-communicator needs (std::nullopt for a negative color); the SDK
//             then constructs it with this instance's Context, so it must not outlive it
//             (the ABI's rule: children are destroyed before their parent).
//             void reduce_scatter(const loom_reduce_scatter_args&)         (since 1.6)
//             CollectiveQueue& collective_queue(): start, test and wait run the blocking
//             calls above on the queue (loom/sdk/collective_queue.hpp), and each blocking
//             call first waits for the queue to empty                    (since 1.6)
struct Comm {
  static constexpr const char* kKind = LOOM_KIND_COMM;
  using sdk_kind = Comm;
};

// What Comm::native_handle returns: e.g. {"nccl", comm}, owned by the instance.
struct NativeHandle {
  const char* kind = nullptr;
  void* handle = nullptr;
};

namespace detail {

// What T::split returns (std::optional<S>), and whether T can make a sub-instance from S.
template <class T>
using SplitPlanOf = typename decltype(std::declval<T&>().split(0, 0))::value_type;
template <class T>
concept CommSplits = requires(T& t, int32_t v) {
  { t.split(v, v).has_value() } -> std::convertible_to<bool>;
  requires std::is_constructible_v<T, Context&, SplitPlanOf<T> &&>;
};

template <class T>
concept CommHasQueue = requires(T& t) {
  { t.collective_queue() } -> std::same_as<CollectiveQueue&>;
};
template <class T>
concept CommReducesScatter = requires(T& t, const loom_reduce_scatter_args& a) {
  t.reduce_scatter(a);
};

template <class T>
struct CommTable {
  using E = Entry<T>;

  // Before a blocking collective: the started ones go first, the same order on every rank.
  static T& in_order(T& obj) {
    if constexpr (CommHasQueue<T>) obj.collective_queue().drain();
    return obj;
  }

  static int32_t rank(void* instance) noexcept {
    return E::template value<int32_t>(-1, instance, [](T& obj) { return obj.rank(); });
  }
  static int32_t size(void* instance) noexcept {
    return E::template value<int32_t>(0, instance, [](T& obj) { return obj.size(); });
  }
  static int32_t supports_device(void* instance, DLDevice device) noexcept {
    return E::template value<int32_t>(0, instance,
                                      [&](T& obj) { return obj.supports_device(device) ? 1 : 0; });
  }
  static loom_status* allreduce(void* instance, const loom_allreduce_args* args) noexcept {
    return E::forward(instance, args, "allreduce args",
                      [](T& obj, const auto& a) { in_order(obj).allreduce(a); });
  }
  static loom_status* allgather(void* instance, const loom_allgather_args* args) noexcept {
    return E::forward(instance, args, "allgather args",
                      [](T& obj, const auto& a) { in_order(obj).allgather(a); });
  }
  static loom_status* all_to_all(void* instance, const loom_all_to_all_args* args) noexcept {
    return E::forward(instance, args, "all_to_all args",
                      [](T& obj, const auto& a) { in_order(obj).all_to_all(a); });
  }
  static loom_status* broadcast(void* instance, const loom_broadcast_args* args) noexcept {
    return E::forward(instance, args, "broadcast args",
                      [](T& obj, const auto& a) { in_order(obj).broadcast(a); });
  }
  static loom_status* barrier(void* instance, void* stream) noexcept {
    return E::plain(instance,
                    [&](const Instance<T>& self) { in_order(self.object()).barrier(stream); });
  }
  static loom_status* stats(void* instance, loom_comm_stats* out) noexcept {
    return E::filled(instance, out, "stats out", [](T& obj, auto& full) { obj.stats(full); });
  }
  static loom_status* native_handle(void* instance, const char** kind, void** handle) noexcept {
    return E::plain(instance, [&](const Instance<T>& self) {
      if (kind == nullptr || handle == nullptr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, "native_handle outputs are NULL");
      }
      NativeHandle h = self.object().native_handle();
      *kind = h.kind;
      *handle = h.handle;
    });
  }
  // ---- since 1.2
  static loom_status* split(void* instance, loom_comm_split_args* args) noexcept {
    return E::checked(instance, args, LOOM_STRUCT_SIZE(loom_comm_split_args, result), "split args",
                      [](loom_comm_split_args& a, const Instance<T>& self) {
                        a.result = nullptr;
                        Holder<T>& h = self.holder();
                        h.forget_export();
                        auto plan = in_order(h.object).split(a.color, a.key);
                        if (!plan.has_value()) return;
                        // bad_alloc is caught by guard() and reported as RESOURCE_EXHAUSTED.
                        a.result = new Holder<T>(h.ctx.raw(), std::in_place,  // NOLINT
                                                 std::move(*plan));
                      });
  }
  static void destroy_split(void* instance) noexcept {
    try {
      delete static_cast<Holder<T>*>(instance);
    } catch (...) {
    }
  }
  static loom_status* barrier2(void* instance, const loom_comm_barrier_args* args) noexcept {
    return E::checked(instance, args, LOOM_STRUCT_SIZE(loom_comm_barrier_args, stream),
                      "barrier args", [](const loom_comm_barrier_args& a, const Instance<T>& self) {
                        in_order(self.object()).barrier(a.stream);
                      });
  }
  static loom_status* supports_device2(void* instance, loom_comm_device_args* args) noexcept {
    return E::checked(instance, args, LOOM_STRUCT_SIZE(loom_comm_device_args, supported),
                      "device args", [](loom_comm_device_args& a, const Instance<T>& self) {
                        a.supported = self.object().supports_device(a.device) ? 1 : 0;
                      });
  }
  static loom_status* native_handle2(void* instance, loom_comm_native_handle_args* args) noexcept {
    return E::checked(instance, args, LOOM_STRUCT_SIZE(loom_comm_native_handle_args, handle),
                      "native_handle args",
                      [](loom_comm_native_handle_args& a, const Instance<T>& self) {
                        NativeHandle h = self.object().native_handle();
                        a.kind = h.kind;
                        a.handle = h.handle;
                      });
  }

  // ---- since 1.6
  static loom_status* reduce_scatter(void* instance,
                                     const loom_reduce_scatter_args* args) noexcept {
    return E::forward(instance, args, "reduce_scatter args",
                      [](T& obj, const auto& a) { in_order(obj).reduce_scatter(a); });
  }
  // Queues the collective with a full-size copy of its args struct (the tensors it points to
  // are the caller's until wait).
  static loom_status* start(void* instance, loom_comm_start_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_STRUCT_SIZE(loom_comm_start_args, request), "start args",
        [](loom_comm_start_args& a, const Instance<T>& self) {
          a.request = nullptr;
          T& obj = self.object();
          CollectiveQueue& q = obj.collective_queue();
          switch (a.collective) {
            case LOOM_COLLECTIVE_ALLREDUCE: {
              const auto c =
                  normalized(static_cast<const loom_allreduce_args*>(a.args), "allreduce args");
              a.request = q.start([&obj, c] { obj.allreduce(c); });
              return;
            }
            case LOOM_COLLECTIVE_ALLGATHER: {
              const auto c =
                  normalized(static_cast<const loom_allgather_args*>(a.args), "allgather args");
              a.request = q.start([&obj, c] { obj.allgather(c); });
              return;
            }
            case LOOM_COLLECTIVE_REDUCE_SCATTER: {
              if constexpr (CommReducesScatter<T>) {
                const auto c = normalized(static_cast<const loom_reduce_scatter_args*>(a.args),
                                          "reduce_scatter args");
                a.request = q.start([&obj, c] { obj.reduce_scatter(c); });
                return;
              } else {
                throw Error(LOOM_ERR_UNIMPLEMENTED, "this transport has no reduce_scatter");
              }
            }
            case LOOM_COLLECTIVE_ALL_TO_ALL: {
              const auto c =
                  normalized(static_cast<const loom_all_to_all_args*>(a.args), "all_to_all args");
              a.request = q.start([&obj, c] { obj.all_to_all(c); });
              return;
            }
            case LOOM_COLLECTIVE_BROADCAST: {
              const auto c =
                  normalized(static_cast<const loom_broadcast_args*>(a.args), "broadcast args");
              a.request = q.start([&obj, c] { obj.broadcast(c); });
              return;
            }
            default:
              throw Error(LOOM_ERR_INVALID_ARGUMENT, "start: unknown collective " +
                                                         std::to_string(a.collective) +
                                                         " (loom_comm_collective is 0..4)");
          }
        });
  }
  static loom_status* test(void* instance, loom_comm_request_args* args) noexcept {
    return E::checked(instance, args, LOOM_STRUCT_SIZE(loom_comm_request_args, request),
                      "request args", [](loom_comm_request_args& a, const Instance<T>& self) {
                        a.done = 0;
                        a.done = self.object().collective_queue().test(a.request) ? 1 : 0;
                      });
  }
  static loom_status* wait(void* instance, const loom_comm_request_args* args) noexcept {
    return E::checked(instance, args, LOOM_STRUCT_SIZE(loom_comm_request_args, request),
                      "request args", [](const loom_comm_request_args& a, const Instance<T>& self) {
                        self.object().collective_queue().wait(a.request);
                      });
  }

  static const loom_comm_v1* get() {
    static_assert(
        requires(T & t) {
          { t.rank() } -> std::convertible_to<int32_t>;
          { t.size() } -> std::convertible_to<int32_t>;
        },
        "a Comm needs int32_t rank() and int32_t size()");
    static_assert(
        requires(T & t, DLDevice d) {
          { t.supports_device(d) } -> std::convertible_to<bool>;
        },
        "a Comm needs bool supports_device(DLDevice)");
    static_assert(
        requires(T & t, const loom_allreduce_args& a, const loom_allgather_args& g,
                 const loom_all_to_all_args& x, const loom_broadcast_args& b) {
          t.allreduce(a);
          t.allgather(g);
          t.all_to_all(x);
          t.broadcast(b);
        },
        "a Comm needs allreduce, allgather, all_to_all and broadcast taking their args");
    static_assert(
        requires(T & t, void* s, loom_comm_stats& st) {
          t.barrier(s);
          t.stats(st);
        },
        "a Comm needs void barrier(void* stream) and void stats(loom_comm_stats&)");
    static const loom_comm_v1 table = [] {
      loom_comm_v1 v{};
      v.struct_size = LOOM_COMM_V1_SIZE;
      v.rank = &rank;
      v.size = &size;
      v.supports_device = &supports_device;
      v.allreduce = &allreduce;
      v.allgather = &allgather;
      v.all_to_all = &all_to_all;
      v.broadcast = &broadcast;
      v.barrier = &barrier;
      v.stats = &stats;
      v.barrier2 = &barrier2;  // beside barrier and supports_device, for 1.0 and 1.1 hosts
      v.supports_device2 = &supports_device2;
      if constexpr (requires(T & t) {
                      { t.native_handle() } -> std::convertible_to<NativeHandle>;
                    }) {
        v.native_handle = &native_handle;
        v.native_handle2 = &native_handle2;
      }
      if constexpr (CommSplits<T>) {
        v.split = &split;
        v.destroy_split = &destroy_split;
      }
      if constexpr (CommReducesScatter<T>) v.reduce_scatter = &reduce_scatter;
      if constexpr (CommHasQueue<T>) {
        v.start = &start;
        v.test = &test;
        v.wait = &wait;
      }
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Comm> {
  template <class T>
  static const void* table() {
    return CommTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_COMM_HPP
