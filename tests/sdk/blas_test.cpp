// loom/sdk/blas.hpp, built twice: against OpenBLAS's pthread build (concurrent calls run at
// once) and against its serial build (which has no locking, so calls must take turns). In both,
// GEMMs issued from many threads at once give the bits of the same GEMMs run one by one.
#include <gtest/gtest.h>
#include <loom/sdk/blas.hpp>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#ifndef LOOM_TEST_BLAS_BUILD
#error "define LOOM_TEST_BLAS_BUILD to 0 (serial) or 1 (pthread)"
#endif

namespace {

struct Problem {
  int m, n, k;
  std::vector<float> a, b, c;
};

// Sizes past OpenBLAS's small-matrix path, so its packing buffers are used.
Problem make(int index) {
  Problem p{96 + index % 5, 80 + index % 7, 128, {}, {}, {}};
  p.a.resize(static_cast<size_t>(p.m) * p.k);
  p.b.resize(static_cast<size_t>(p.k) * p.n);
  p.c.assign(static_cast<size_t>(p.m) * p.n, 0.0F);
  uint32_t s = 2463534242U + static_cast<uint32_t>(index);
  auto next = [&] {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return static_cast<float>(s % 2001) / 1000.0F - 1.0F;
  };
  for (auto& v : p.a) v = next();
  for (auto& v : p.b) v = next();
  return p;
}

void run(Problem& p) {
  loom::sdk::blas::gemm(false, false, p.m, p.n, p.k, 1.0F, p.a.data(), p.k, p.b.data(), p.n, 0.0F,
                        p.c.data(), p.n);
}

TEST(Blas, TheLoadedBuildIsTheLinkedOne) {
  EXPECT_EQ(openblas_get_parallel(), LOOM_TEST_BLAS_BUILD) << openblas_get_config();
  EXPECT_EQ(loom::sdk::blas::concurrent_calls_safe(), LOOM_TEST_BLAS_BUILD == 1);
}

TEST(Blas, ConcurrentCallsGiveTheBitsOfOneByOne) {
  constexpr int kThreads = 4, kPerThread = 24;
  std::vector<Problem> serial, parallel;
  for (int i = 0; i < kThreads * kPerThread; ++i) {
    serial.push_back(make(i));
    parallel.push_back(make(i));
  }
  for (auto& p : serial) run(p);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) run(parallel[static_cast<size_t>(t * kPerThread + i)]);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < serial.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(serial[i].c.data(), parallel[i].c.data(),
                             serial[i].c.size() * sizeof(float)))
        << "problem " << i;
  }
}

TEST(Blas, DimensionsOutsideTheBlasRangeAreRefused) {
  float x = 0.0F;
  EXPECT_THROW(
      loom::sdk::blas::gemm(false, false, int64_t{1} << 31, 1, 1, 1.0F, &x, 1, &x, 1, 0.0F, &x, 1),
      std::invalid_argument);
  EXPECT_THROW(loom::sdk::blas::gemm(false, false, -1, 1, 1, 1.0F, &x, 1, &x, 1, 0.0F, &x, 1),
               std::invalid_argument);
}

}  // namespace
