// loom-bench-comm: fp32 allreduce over a Loom transport (--transport, default `ucx`; `mpi`
// for the transport over the MPI library's collectives) beside OpenMPI's MPI_Allreduce on the
// same data in the same run, for message sizes from --min-bytes to --max-bytes (powers of 4),
// then the codec benchmarks (over the same transport) when they are built in
// (codec_bench.hpp).
//
//   mpirun -np 4 build/release/bin/loom bench comm [--transport ucx|mpi] [--min-bytes 1M]
//          [--max-bytes 256M] [--iters N] [--transport-only]
//
// One JSON object per line, printed by rank 0:
//   {"bench":"allreduce","impl":T|"mpi","transport":NAME,"op":"sum","dtype":"float32",
//    "elements":N,"bytes":B,"ranks":P,"iters":I,"seconds":median,"seconds_min":best,
//    "wire_bytes_per_rank":W,"algbw_gbps":B/s,"busbw_gbps":algbw*2(P-1)/P}
//   {"bench":"allreduce_ratio","bytes":B,"transport":NAME,"T_over_mpi_time":t_T/t_mpi}
// T is the transport's name ("ucx"), or "mpi_transport" for the mpi transport, so that "mpi"
// always means MPI_Allreduce called directly. wire_bytes_per_rank is what the transport's
// counters say one rank sent for one call (for MPI, the ring volume 2 (P-1)/P * B, since MPI
// does not report it). MPI is initialised with MPI_THREAD_FUNNELED, or MPI_THREAD_MULTIPLE
// for the mpi transport (what the host asks for when it initialises MPI, and what that
// transport needs to run started collectives on a thread of its own).
#include <loom/embed.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <loom_cli_support.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_context.hpp"
#include "bench_support.hpp"
#if __has_include("codec_bench.hpp") && defined(LOOM_BENCH_HAVE_CODECS)
#include "codec_bench.hpp"
#endif

namespace {

using loom::bench::Clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void print(const nlohmann::json& j) { loom::bench::emit(j); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fp32 allreduce over a Loom transport (ucx, or --transport mpi) beside OpenMPI's\n"
      "MPI_Allreduce, message sizes from --min-bytes to --max-bytes in powers of 4, then the\n"
      "codec benchmarks; one JSON object per line. Run under mpirun: mpirun -np 4 loom bench\n"
      "comm"};
  loom_cli::configure(app, "loom bench comm");
  std::string min_text = "1M", max_text = "256M";
  int iters = 0;  // 0: chosen per size
  bool transport_only = false;
  std::string transport = "ucx";
  app.add_option("--min-bytes", min_text, "Smallest message (K, M, G: 1024 multiples)")
      ->check(loom_cli::size_validator())
      ->type_name("SIZE");
  app.add_option("--max-bytes", max_text, "Largest message")
      ->check(loom_cli::size_validator())
      ->type_name("SIZE");
  app.add_option("--iters", iters, "Timed calls per size (0: chosen per size)")
      ->check(loom_cli::integer_in(0, 1000000))
      ->type_name("N");
  app.add_flag("--transport-only", transport_only, "Time the transport only, not the codecs");
  app.add_option("--transport", transport,
                 "The [comm.world] plugin to time: ucx (default), mpi, or another transport "
                 "on host memory")
      ->type_name("NAME");
  if (const int rc = loom_cli::parse(app, argc, argv, false); rc >= 0) return rc;
  const std::size_t min_bytes = *loom_cli::parse_size(min_text);
  const std::size_t max_bytes = *loom_cli::parse_size(max_text);
  if (min_bytes > max_bytes) {
    return loom_cli::usage_error(
        "loom bench comm", "--min-bytes " + min_text + " is larger than --max-bytes " + max_text);
  }

  if (transport.empty() ||
      transport.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
    return loom_cli::usage_error("loom bench comm",
                                 "--transport '" + transport + "' is not a plugin name");
  }
  // How the rows name the transport: "mpi" is MPI_Allreduce itself.
  const std::string impl = transport == "mpi" ? "mpi_transport" : transport;

  // MPI first: the host's bootstrap sees MPI_Initialized and reuses it.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, transport == "mpi" ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED,
                  &provided);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  loom_session* session = nullptr;
  // ucx's own timeout, raised for the largest sizes; other transports take their defaults.
  const std::string manifest = "[comm.world]\nplugin = \"" + transport + "\"\n" +
                               (transport == "ucx" ? "timeout_s = 300.0\n" : "");
  if (loom_open_string(manifest.c_str(), "comm_bench.toml", nullptr, &session) != LOOM_OK) {
    std::fprintf(stderr, "loom-bench-comm: rank %d: %s\n", rank, loom_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  loom_instance* inst = nullptr;
  loom_find_instance(session, "comm", "world", &inst);
  void* obj = loom_instance_object(inst);
  const auto* vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(inst));

  std::vector<std::size_t> sizes;
  for (std::size_t b = min_bytes; b <= max_bytes; b *= 4) sizes.push_back(b / 4 * 4);

  for (std::size_t bytes : sizes) {
    const std::size_t n = bytes / 4;
    const int it =
        iters > 0 ? iters : std::max(3, std::min(20, static_cast<int>((64U << 20) / bytes)));
    std::vector<float> data(n);
    std::vector<float> mpi_out(n);
    for (std::size_t i = 0; i < n; ++i)
      data[i] = static_cast<float>((i + static_cast<std::size_t>(rank)) % 7);
    int64_t shape = static_cast<int64_t>(n);
    DLTensor t{data.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};

    std::vector<double> loom_t;
    std::vector<double> mpi_t;
    uint64_t wire = 0;
    // Interleaved, so both see the same machine state; one warm-up each.
    for (int k = -1; k < it; ++k) {
      loom_comm_stats before{};
      before.struct_size = LOOM_COMM_STATS_SIZE;
      vt->stats(obj, &before);
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = Clock::now();
      loom_allreduce_args args{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &t, nullptr};
      loom_status* st = vt->allreduce(obj, &args);
      const double loom_s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (st != nullptr) {
        std::fprintf(stderr, "loom-bench-comm: rank %d: %s allreduce: %s\n", rank,
                     transport.c_str(), st->message);
        st->destroy(st);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      loom_comm_stats after{};
      after.struct_size = LOOM_COMM_STATS_SIZE;
      vt->stats(obj, &after);
      wire = after.bytes_sent - before.bytes_sent;

      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      MPI_Allreduce(data.data(), mpi_out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      const double mpi_s = std::chrono::duration<double>(Clock::now() - t0).count();
      // The slowest rank's time is the collective's time.
      double both[2] = {loom_s, mpi_s};
      double worst[2] = {0, 0};
      MPI_Allreduce(both, worst, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (k >= 0) {
        loom_t.push_back(worst[0]);
        mpi_t.push_back(worst[1]);
      }
      // Keep values small: sum back to the start for the next round.
      for (std::size_t i = 0; i < n; ++i)
        data[i] = static_cast<float>((i + static_cast<std::size_t>(rank)) % 7);
    }
    if (rank == 0) {
      const double factor = 2.0 * (size - 1) / size;
      for (int which = 0; which < 2; ++which) {
        const std::vector<double>& v = which == 0 ? loom_t : mpi_t;
        const double s = median(v);
        const double algbw = static_cast<double>(bytes) / s / 1e9;
        print({{"bench", "allreduce"},
               {"impl", which == 0 ? impl : "mpi"},
               {"transport", transport},
               {"op", "sum"},
               {"dtype", "float32"},
               {"elements", n},
               {"bytes", bytes},
               {"ranks", size},
               {"iters", it},
               {"seconds", s},
               {"seconds_min", *std::min_element(v.begin(), v.end())},
               {"wire_bytes_per_rank",
                which == 0 ? wire : static_cast<uint64_t>(factor * static_cast<double>(bytes))},
               {"algbw_gbps", algbw},
               {"busbw_gbps", algbw * factor}});
      }
      print({{"bench", "allreduce_ratio"},
             {"bytes", bytes},
             {"ranks", size},
             {"transport", transport},
             {impl + "_over_mpi_time", median(loom_t) / median(mpi_t)}});
    }
  }

#if __has_include("codec_bench.hpp") && defined(LOOM_BENCH_HAVE_CODECS)
  if (!transport_only) {
    loom_bench::CommBenchContext ctx{session, rank, size, sizes, iters > 0 ? iters : 5};
    loom_bench::run_codec_benchmarks(ctx);
  }
#else
  (void)transport_only;
#endif

  loom_close(session);
  MPI_Finalize();
  return 0;
}
