// Old codecs under today's bundled consumer: onebit_adam (built with today's SDK) averages over
// 2 thread ranks (the thread_comm test transport) with its compressed allreduce, whose codec is
// the ABI 1.0 fixture (a table that ends at decode, so the server step decodes chunk by chunk)
// or the ABI 1.1 one (decode_sum, one pass). decode_sum is specified bit-identical to the
// chunk-by-chunk path, so both runs give the same bits; the 1.0 table ends where an
// inaccessible page begins, so reading its absent decode_sum would fault.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "compat_support.hpp"

namespace {

struct RankResult {
  int32_t rc = -1;
  std::string error;
  std::vector<float> params;
  loom_optimizer_comm_info info{};
};

// One rank: a session of its own, 6 steps (2 of warmup, then compressed).
RankResult run_rank(const std::string& codec, const std::string& world, int rank) {
  RankResult r;
  compat_test::Session s(std::string(LOOM_COMPAT_PLUGIN_DIR) + ":" + LOOM_TEST_PLUGIN_DIR);
  r.rc = s.open("[comm.w]\nplugin = \"thread_comm\"\nworld = \"" + world +
                "\"\nrank = " + std::to_string(rank) +
                "\nsize = 2\ntimeout_s = 30\n[codec.c]\nplugin = \"" + codec +
                "\"\n[optimizer.o]\nplugin = \"onebit_adam\"\ncomm = \"w\"\ncodec = \"c\"\n"
                "freeze_step = 2\n");
  if (r.rc != LOOM_OK) {
    r.error = s.error();
    return r;
  }
  loom_instance* opt = nullptr;
  r.rc = loom_find_instance(s.session(), "optimizer", "o", &opt);
  if (r.rc != LOOM_OK) {
    r.error = loom_last_error();
    return r;
  }
  r.params.resize(37);
  for (size_t i = 0; i < r.params.size(); ++i) r.params[i] = 0.1F * static_cast<float>(i);
  std::vector<float> grad(r.params.size());
  float* params[] = {r.params.data()};
  const float* grads[] = {grad.data()};
  const int64_t numels[] = {static_cast<int64_t>(r.params.size())};
  for (int step = 1; step <= 6; ++step) {
    for (size_t i = 0; i < grad.size(); ++i) {
      grad[i] = std::sin(static_cast<float>(i * (rank + 1) + static_cast<size_t>(step)));
    }
    r.rc = loom_optimizer_step_f32(opt, params, grads, numels, 1, 0.01);
    if (r.rc != LOOM_OK) {
      r.error = "step " + std::to_string(step) + ": " + loom_last_error();
      return r;
    }
  }
  r.info.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  r.rc = loom_optimizer_get_comm_info(opt, &r.info);
  if (r.rc != LOOM_OK) r.error = loom_last_error();
  return r;
}

std::vector<RankResult> run_world(const std::string& codec) {
  std::vector<RankResult> results(2);
  std::vector<std::thread> threads;
  const std::string world = "compat_" + codec;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] { results[rank] = run_rank(codec, world, rank); });
  }
  for (auto& t : threads) t.join();
  return results;
}

TEST(CompatBundled, OnebitAdamGivesTheSameBitsOverTheOneZeroAndOneOneCodecs) {
  const auto old_run = run_world("compat10_codec");
  const auto new_run = run_world("compat11_codec");
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    ASSERT_EQ(old_run[rank].rc, LOOM_OK) << old_run[rank].error;
    ASSERT_EQ(new_run[rank].rc, LOOM_OK) << new_run[rank].error;
    // The compressed allreduce leaves every rank with the same bits, whichever codec table.
    EXPECT_EQ(old_run[rank].params, old_run[0].params);
    EXPECT_EQ(new_run[rank].params, old_run[rank].params);
    // It did communicate compressed: 4 + 1 bytes per element and chunk against fp32's 4.
    EXPECT_EQ(old_run[rank].info.owns_communication, 1);
    EXPECT_GT(old_run[rank].info.bytes_sent, 0U);
    EXPECT_LT(old_run[rank].info.bytes_sent, old_run[rank].info.uncompressed_bytes_sent);
    EXPECT_EQ(new_run[rank].info.bytes_sent, old_run[rank].info.bytes_sent);
  }
  EXPECT_NE(old_run[0].params[5], 0.5F);  // the parameters moved
  for (const float v : old_run[0].params) EXPECT_TRUE(std::isfinite(v));
}

}  // namespace
