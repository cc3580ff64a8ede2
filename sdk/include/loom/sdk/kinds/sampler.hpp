// The "loom.sampler/1" kind in the SDK (loom/kinds/sampler.h): the base class a batch sampler
// derives from and the table the SDK builds from it.
#ifndef LOOM_SDK_KINDS_SAMPLER_HPP
#define LOOM_SDK_KINDS_SAMPLER_HPP

#include <loom/kinds/sampler.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/tensor.hpp>

#include <string>

namespace loom::sdk {

// "loom.sampler/1" (since 1.3)
//   required: void plan(loom_sampler_plan_args&), void next(loom_sampler_next_args&)
//   Before plan the SDK checks dataset_size >= 1, global_batch >= 1 and world_size >= 1;
//   before next, step >= 1, world_size >= 1, 0 <= rank < world_size, and that indices is an
//   int64 1-D contiguous tensor in host memory. That indices holds plan's capacity and that
//   world_size matches plan's are the class's to check (it knows its plan).
struct Sampler {
  static constexpr const char* kKind = LOOM_KIND_SAMPLER;
  using sdk_kind = Sampler;
};

namespace detail {

template <class T>
struct SamplerTable {
  using E = Entry<T>;

  static loom_status* plan(void* instance, loom_sampler_plan_args* args) noexcept {
    return E::checked(instance, args, LOOM_SAMPLER_PLAN_ARGS_SIZE, "sampler plan args",
                      [](loom_sampler_plan_args& a, const Instance<T>& self) {
                        if (a.dataset_size < 1) fail_argument("sampler plan: dataset_size is 0");
                        if (a.global_batch < 1) {
                          fail_argument("sampler plan: global_batch is " +
                                        std::to_string(a.global_batch) + "; must be >= 1");
                        }
                        if (a.world_size < 1) {
                          fail_argument("sampler plan: world_size is " +
                                        std::to_string(a.world_size) + "; must be >= 1");
                        }
                        fill(&a, "sampler plan args", [&](loom_sampler_plan_args& full) {
                          full.capacity = 0;
                          self.object().plan(full);
                        });
                      });
  }
  static loom_status* next(void* instance, loom_sampler_next_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_SAMPLER_NEXT_ARGS_SIZE, "sampler next args",
        [](loom_sampler_next_args& a, const Instance<T>& self) {
          if (a.step < 1) {
            fail_argument("sampler next: step is " + std::to_string(a.step) + "; steps start at 1");
          }
          if (a.world_size < 1) {
            fail_argument("sampler next: world_size is " + std::to_string(a.world_size) +
                          "; must be >= 1");
          }
          if (a.rank < 0 || a.rank >= a.world_size) {
            fail_argument("sampler next: rank " + std::to_string(a.rank) + " is outside 0 .. " +
                          std::to_string(a.world_size - 1));
          }
          const DLTensor& idx = expect_tensor(a.indices, "indices");
          if (idx.ndim != 1) fail_argument("indices is not 1-D: shape " + shape_string(idx));
          expect_dtype(idx, DLDataType{kDLInt, 64, 1}, "indices");
          expect_contiguous(idx, "indices");
          expect_cpu(idx, "indices");
          fill(&a, "sampler next args", [&](loom_sampler_next_args& full) {
            full.count = 0;
            full.difficulty = 0;
            full.epoch = 0;
            full.consumed = 0;
            self.object().next(full);
          });
        });
  }

  static const loom_sampler_v1* get() {
    static_assert(
        requires(T & t, loom_sampler_plan_args & p, loom_sampler_next_args & n) {
          t.plan(p);
          t.next(n);
        },
        "a Sampler needs void plan(loom_sampler_plan_args&) and void "
        "next(loom_sampler_next_args&)");
    static const loom_sampler_v1 table = [] {
      loom_sampler_v1 v{};
      v.struct_size = LOOM_SAMPLER_V1_SIZE;
      v.plan = &plan;
      v.next = &next;
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Sampler> {
  template <class T>
  static const void* table() {
    return SamplerTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_SAMPLER_HPP
