// host/src/tcp_bootstrap.cpp: the torchrun-style bootstrap (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT). The bootstrap is process-wide, so every rank is a process of
// loom_bootstrap_peer (bootstrap/peer.cpp) on 127.0.0.1 and a free port: allgather and
// barrier rounds across 2, 3 and 4 processes, rank 0 starting last, a rank that comes just
// before the timeout with a large block, and every bad launch (missing or malformed
// variables, a rank that never starts, a rank with another WORLD_SIZE or a RANK already
// taken, which are turned away while the job goes on, idle connections, a rank that dies, a
// rank whose collective failed, mismatched collectives) failing with an error that names the
// problem, well before the test's limit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "free_port.hpp"
#include "loom_test.hpp"

extern char** environ;  // NOLINT

namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using Env = std::map<std::string, std::string>;

using loom_test_common::free_port;

// A connection to 127.0.0.1:port, retried for up to 10 s (-1 if none): tells when rank 0
// listens. Rank 0 drops a connection that closes without a hello.
int connect_when_listening(int port) {
  for (int i = 0; i < 1000; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;  // NOLINT
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

struct Proc {
  pid_t pid = -1;
  std::filesystem::path log;
  int code = -1;  // exit status; -1 when killed (it hung)
  std::string out;
};

class EnvBootstrap : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = free_port();
    ASSERT_GT(port_, 0);
  }

  // The variables of rank `rank` of `world` on 127.0.0.1:port_.
  [[nodiscard]] Env rank_env(int rank, int world, double timeout_s = 30) const {
    return {{"RANK", std::to_string(rank)},
            {"WORLD_SIZE", std::to_string(world)},
            {"LOCAL_RANK", std::to_string(rank)},
            {"MASTER_ADDR", "127.0.0.1"},
            {"MASTER_PORT", std::to_string(port_)},
            {"LOOM_BOOTSTRAP_TIMEOUT", std::to_string(timeout_s)}};
  }

  // Starts loom_bootstrap_peer with this environment's variables minus every launcher's,
  // plus `env` (an empty value leaves the variable out).
  Proc start(const Env& env, const std::vector<std::string>& args = {}) {
    Proc p;
    p.log = dir_.path() / ("peer-" + std::to_string(count_++) + ".log");
    std::vector<std::string> vars;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string v = *e;
      const std::string name = v.substr(0, v.find('='));
      const bool launcher = name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" ||
                            name == "MASTER_ADDR" || name == "MASTER_PORT" ||
                            name.rfind("LOOM_BOOTSTRAP", 0) == 0 ||
                            name.rfind("TORCHELASTIC_", 0) == 0 || name.rfind("OMPI_", 0) == 0 ||
                            name.rfind("PMIX_", 0) == 0 || name.rfind("PMI_", 0) == 0;
      if (!launcher) vars.push_back(v);
    }
    for (const auto& [k, v] : env) {
      if (!v.empty()) vars.push_back(k + "=" + v);
    }
    std::vector<char*> envp;
    for (auto& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_s{LOOM_BOOTSTRAP_PEER};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, p.log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    const int rc = posix_spawn(&p.pid, argv[0], &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    EXPECT_EQ(rc, 0) << "posix_spawn " << argv[0] << ": " << std::strerror(rc);
    if (rc != 0) p.pid = -1;
    return p;
  }

  // Waits for every process up to `limit` seconds, then kills what is left (code -1).
  static void wait_all(std::vector<Proc>& procs, double limit = 60) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(limit);
    for (auto& p : procs) {
      if (p.pid < 0) continue;
      int st = 0;
      for (;;) {
        const pid_t r = ::waitpid(p.pid, &st, WNOHANG);
        if (r == p.pid) {
          p.code = WIFEXITED(st) ? WEXITSTATUS(st) : -2;
          break;
        }
        if (Clock::now() > deadline) {
          ::kill(p.pid, SIGKILL);
          ::waitpid(p.pid, &st, 0);
          p.code = -1;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      p.pid = -1;  // reaped: a second wait_all leaves it alone
      std::ifstream f(p.log);
      std::stringstream s;
      s << f.rdbuf();
      p.out = s.str();
    }
  }

  // Runs a world of `world` ranks to completion.
  std::vector<Proc> run_world(int world, const std::vector<std::string>& args = {},
                              double timeout_s = 30) {
    std::vector<Proc> procs;
    for (int r = 0; r < world; ++r) procs.push_back(start(rank_env(r, world, timeout_s), args));
    wait_all(procs);
    return procs;
  }

  // One process with exactly these variables set: its output (it must exit with 3).
  std::string fails_to_start(const Env& env) {
    std::vector<Proc> one{start(env)};
    wait_all(one, 30);
    EXPECT_EQ(one[0].code, 3) << one[0].out;
    return one[0].out;
  }

  [[nodiscard]] std::string where() const { return "127.0.0.1:" + std::to_string(port_); }

  loom_test::TempDir dir_;
  int port_ = 0;
  int count_ = 0;
};

// The last field of an "ok ..." line (the hash of everything gathered).
std::string sum_of(const std::string& out) {
  const auto at = out.find(" sum ");
  return at == std::string::npos ? "" : out.substr(at + 5, out.find('\n', at) - at - 5);
}

TEST_F(EnvBootstrap, AllgatherAndBarrierAgreeOnTwoAndFourRanks) {
  for (const int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    port_ = free_port();
    auto procs = run_world(world);
    std::string sum;
    for (int r = 0; r < world; ++r) {
      const Proc& p = procs[static_cast<size_t>(r)];
      ASSERT_EQ(p.code, 0) << p.out;
      const std::string rs = std::to_string(r), ws = std::to_string(world);
      EXPECT_THAT(p.out, HasSubstr("how: env: rank " + rs + " of " + ws + " via " + where()));
      EXPECT_THAT(p.out, HasSubstr("ok rank " + rs + " of " + ws + " local " + rs + " rounds 12"));
      if (r == 0) sum = sum_of(p.out);
      EXPECT_FALSE(sum.empty());
      EXPECT_EQ(sum_of(p.out), sum) << "rank " << r << " gathered something else";
    }
  }
}

TEST_F(EnvBootstrap, OtherRanksWaitForARankZeroThatStartsLater) {
  // LOCAL_RANK unset: worked out from the host names (all the same here), so it is the rank.
  std::vector<Proc> procs(3);
  for (int r = 1; r < 3; ++r) {
    Env e = rank_env(r, 3);
    e["LOCAL_RANK"] = "";
    procs[static_cast<size_t>(r)] = start(e);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  Env e0 = rank_env(0, 3);
  e0["LOCAL_RANK"] = "";
  procs[0] = start(e0);
  wait_all(procs);
  for (int r = 0; r < 3; ++r) {
    const Proc& p = procs[static_cast<size_t>(r)];
    ASSERT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("ok rank " + std::to_string(r) + " of 3 local " +
                                 std::to_string(r) + " rounds 12"));
    EXPECT_EQ(sum_of(p.out), sum_of(procs[0].out));
  }
}

// A listening socket on 127.0.0.1:port (-1 if the port is taken): stands for torchrun's
// agent store.
int listen_on(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||  // NOLINT
      ::listen(fd, 16) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent's store holds MASTER_PORT:
// rank 0 listens on the next port; LOOM_BOOTSTRAP_PORT picks another one.
TEST_F(EnvBootstrap, TorchrunsAgentStoreKeepsMasterPort) {
  int store = -1;
  for (int i = 0; i < 20 && store < 0; ++i) {
    port_ = free_port();
    store = listen_on(port_);
    const int next = listen_on(port_ + 1);  // the next port must be free too
    if (next < 0 && store >= 0) {
      ::close(store);
      store = -1;
    }
    if (next >= 0) ::close(next);
  }
  ASSERT_GE(store, 0);
  std::vector<Proc> procs;
  for (int r = 0; r < 2; ++r) {
    Env e = rank_env(r, 2);
    e["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    procs.push_back(start(e, {"--rounds", "3"}));
  }
  wait_all(procs);
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("via 127.0.0.1:" + std::to_string(port_ + 1)));
  }
  const int own = free_port();
  procs.clear();
  for (int r = 0; r < 2; ++r) {
    Env e = rank_env(r, 2);
    e["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    e["LOOM_BOOTSTRAP_PORT"] = std::to_string(own);
    procs.push_back(start(e, {"--rounds", "3"}));
  }
  wait_all(procs);
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("via 127.0.0.1:" + std::to_string(own)));
  }
  // Without the variable, rank 0 tries MASTER_PORT itself and says what holds it up.
  std::vector<Proc> one{start(rank_env(0, 2))};
  wait_all(one);
  EXPECT_EQ(one[0].code, 3);
  EXPECT_THAT(one[0].out, HasSubstr("cannot listen on port " + std::to_string(port_) +
                                    " (MASTER_PORT): Address already in use"));
  EXPECT_THAT(one[0].out, HasSubstr("set LOOM_BOOTSTRAP_PORT"));
  ::close(store);
}

TEST_F(EnvBootstrap, AWorldOfOneNeedsNoPeers) {
  auto procs = run_world(1, {"--rounds", "3"});
  ASSERT_EQ(procs[0].code, 0) << procs[0].out;
  EXPECT_THAT(procs[0].out, HasSubstr("how: env: rank 0 of 1 via " + where()));
  EXPECT_THAT(procs[0].out, HasSubstr("ok rank 0 of 1 local 0 rounds 3"));
}

TEST_F(EnvBootstrap, AConnectionThatIsNotARankIsIgnored) {
  std::vector<Proc> procs{start(rank_env(0, 2))};
  // Knock on rank 0's port with bytes that are not a hello, then start the real rank 1.
  const int fd = connect_when_listening(port_);
  ASSERT_GE(fd, 0) << "rank 0 never listened";
  const char junk[40] = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(fd, junk, sizeof junk, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof junk));
  procs.push_back(start(rank_env(1, 2)));
  wait_all(procs);
  ::close(fd);
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("ok rank"));
  }
}

// Idle connections that never say hello do not exhaust rank 0's files: with 40 open files
// allowed and 60 idle connections, rank 0 drops the oldest and the job runs.
TEST_F(EnvBootstrap, IdleConnectionsDoNotExhaustRankZero) {
  std::vector<Proc> procs{start(rank_env(0, 2, 20), {"--rounds", "2", "--nofile", "40"})};
  std::vector<int> idle;
  const int first = connect_when_listening(port_);
  ASSERT_GE(first, 0) << "rank 0 never listened";
  idle.push_back(first);
  for (int i = 0; i < 60; ++i) {  // one try each: rank 0 listens already
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port_));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {  // NOLINT
      ADD_FAILURE() << "idle connection " << i << ": " << std::strerror(errno);
      ::close(fd);
      break;
    }
    idle.push_back(fd);
  }
  procs.push_back(start(rank_env(1, 2, 20), {"--rounds", "2"}));
  wait_all(procs, 40);
  for (const int fd : idle) {
    if (fd >= 0) ::close(fd);
  }
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("ok rank"));
  }
}

TEST_F(EnvBootstrap, ARankThatNeverStartsIsNamedWithinTheTimeout) {
  const auto t0 = Clock::now();
  std::vector<Proc> procs{start(rank_env(0, 3, 3)), start(rank_env(1, 3, 3))};
  wait_all(procs, 30);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(took, 15) << "the 3 s bootstrap timeout was not kept";
  EXPECT_EQ(procs[0].code, 3) << procs[0].out;
  EXPECT_THAT(procs[0].out, HasSubstr("error DEADLINE_EXCEEDED"));
  EXPECT_THAT(procs[0].out, HasSubstr("rank 2 of WORLD_SIZE=3 never connected"));
  EXPECT_EQ(procs[1].code, 3) << procs[1].out;
  EXPECT_THAT(procs[1].out, HasSubstr("error DEADLINE_EXCEEDED"));
  // Rank 1 waits a little longer than rank 0, so it reports rank 0's verdict, not its own.
  EXPECT_THAT(procs[1].out, HasSubstr("rank 2 of WORLD_SIZE=3 never connected"));
  EXPECT_THAT(procs[1].out, HasSubstr("[reported to rank 1 of 3 by rank 0]"));
}

// Rank 2 comes to round 1 just before the 3 s timeout, with 16 MiB per rank: rank 0 still
// has its time to send the 64 MiB result to every rank, and every rank checks what it got.
TEST_F(EnvBootstrap, ARankThatComesJustInTimeStillGetsTheResult) {
  auto procs =
      run_world(4, {"--rounds", "3", "--stall", "2", "2.75", "--round1-bytes", "16777216"}, 3);
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_EQ(sum_of(p.out), sum_of(procs[0].out));
  }
}

// Rank 0 stalls past rank 1's timeout: rank 1 fails, stays alive, but shuts its connection,
// so rank 0's next collective sees it closed at once instead of waiting for the timeout.
TEST_F(EnvBootstrap, ARankWhoseCollectiveFailedClosesItsConnection) {
  std::vector<Proc> procs{start(rank_env(0, 2, 2), {"--rounds", "3", "--stall", "0", "5"}),
                          start(rank_env(1, 2, 2), {"--rounds", "3", "--linger", "8"})};
  std::vector<Proc> zero{procs[0]};
  wait_all(zero, 30);
  procs[0] = zero[0];  // reaped
  wait_all(procs, 30);
  EXPECT_EQ(procs[1].code, 4) << procs[1].out;
  EXPECT_THAT(procs[1].out, HasSubstr("error DEADLINE_EXCEEDED: bootstrap allgather #4 (1 bytes "
                                      "per rank): rank 1 of 2 waited 4 s"));
  EXPECT_EQ(zero[0].code, 4) << zero[0].out;
  EXPECT_THAT(zero[0].out, HasSubstr("error UNAVAILABLE: bootstrap"));
  EXPECT_THAT(zero[0].out, HasSubstr("rank 1 closed its connection"));
}

TEST_F(EnvBootstrap, NoRankZeroGivesAnErrorNamingTheAddress) {
  const auto t0 = Clock::now();
  std::vector<Proc> procs{start(rank_env(1, 2, 2))};
  wait_all(procs, 30);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 12);
  EXPECT_EQ(procs[0].code, 3) << procs[0].out;
  EXPECT_THAT(procs[0].out, HasSubstr("error DEADLINE_EXCEEDED"));
  EXPECT_THAT(procs[0].out, HasSubstr("could not reach rank 0 at " + where() + " within 2 s"));
  EXPECT_THAT(procs[0].out, HasSubstr("Connection refused"));
}

// A rank with another WORLD_SIZE (of another job, say) is turned away at once, and rank 0
// goes on waiting: for the right rank 1, which then runs the job; or, when it never comes,
// until the timeout, whose message quotes what was turned away.
TEST_F(EnvBootstrap, ARankWithAnotherWorldSizeIsTurnedAway) {
  const auto t0 = Clock::now();
  std::vector<Proc> procs{start(rank_env(0, 2, 3)), start(rank_env(1, 3, 3))};
  std::vector<Proc> stray{procs[1]};
  wait_all(stray, 30);
  procs[1] = stray[0];  // reaped
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.5)
      << "the stray waited for the timeout instead of hearing rank 0's error";
  wait_all(procs, 30);
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 3) << p.out;
    EXPECT_THAT(p.out, HasSubstr("ranks disagree on WORLD_SIZE: rank 1 (at 127.0.0.1:"));
    EXPECT_THAT(p.out, HasSubstr("has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"));
  }
  EXPECT_THAT(procs[1].out, HasSubstr("error INVALID_ARGUMENT: env bootstrap: ranks disagree"));
  EXPECT_THAT(procs[1].out, HasSubstr("[reported to rank 1 of 3 by rank 0]"));
  EXPECT_THAT(procs[0].out, HasSubstr("error DEADLINE_EXCEEDED: env bootstrap: rank 0 waited 3 s"));
  EXPECT_THAT(procs[0].out, HasSubstr("rank 1 of WORLD_SIZE=2 never connected"));
  EXPECT_THAT(procs[0].out, HasSubstr("rank 0 turned away 1 process: ranks disagree"));

  port_ = free_port();
  procs = {start(rank_env(0, 2)), start(rank_env(1, 3))};
  stray = {procs[1]};
  wait_all(stray, 30);
  procs[1] = start(rank_env(1, 2));
  wait_all(procs);
  EXPECT_EQ(stray[0].code, 3) << stray[0].out;
  EXPECT_THAT(stray[0].out, HasSubstr("has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"));
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("ok rank"));
  }
}

// Waits until one of procs[from..] exits; returns its index (or -1 after `limit` seconds).
int wait_first(std::vector<Proc>& procs, size_t from, double limit) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(limit);
  while (Clock::now() < deadline) {
    for (size_t i = from; i < procs.size(); ++i) {
      int st = 0;
      if (procs[i].pid > 0 && ::waitpid(procs[i].pid, &st, WNOHANG) == procs[i].pid) {
        procs[i].pid = -1;
        procs[i].code = WIFEXITED(st) ? WEXITSTATUS(st) : -2;
        std::ifstream f(procs[i].log);
        std::stringstream s;
        s << f.rdbuf();
        procs[i].out = s.str();
        return static_cast<int>(i);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// The second process with RANK=1 is turned away; the first stays, and with rank 2 the job
// runs. When the missing rank never comes, the timeout's message quotes the duplicate.
TEST_F(EnvBootstrap, ASecondProcessWithTheSameRankIsTurnedAway) {
  std::vector<Proc> procs{start(rank_env(0, 3)), start(rank_env(1, 3)), start(rank_env(1, 3))};
  const int dup = wait_first(procs, 1, 20);
  ASSERT_GE(dup, 1) << "neither process with RANK=1 was turned away";
  EXPECT_EQ(procs[static_cast<size_t>(dup)].code, 3) << procs[static_cast<size_t>(dup)].out;
  EXPECT_THAT(procs[static_cast<size_t>(dup)].out,
              HasSubstr("error INVALID_ARGUMENT: env bootstrap: two processes have RANK=1"));
  EXPECT_THAT(procs[static_cast<size_t>(dup)].out,
              HasSubstr("[reported to rank 1 of 3 by rank 0]"));
  procs.push_back(start(rank_env(2, 3)));
  wait_all(procs);
  for (size_t i = 0; i < procs.size(); ++i) {
    if (static_cast<int>(i) == dup) continue;
    EXPECT_EQ(procs[i].code, 0) << procs[i].out;
    EXPECT_THAT(procs[i].out, HasSubstr("ok rank"));
  }

  port_ = free_port();
  procs = {start(rank_env(0, 3, 3)), start(rank_env(1, 3, 3)), start(rank_env(1, 3, 3))};
  wait_all(procs, 30);
  int turned_away = 0;
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_EQ(procs[i].code, 3) << procs[i].out;
    if (procs[i].out.find("error INVALID_ARGUMENT: env bootstrap: two processes have RANK=1") !=
        std::string::npos) {
      ++turned_away;
    } else {
      EXPECT_THAT(procs[i].out, HasSubstr("rank 2 of WORLD_SIZE=3 never connected"));
    }
  }
  EXPECT_EQ(turned_away, 1);
  EXPECT_EQ(procs[0].code, 3) << procs[0].out;
  EXPECT_THAT(procs[0].out, HasSubstr("error DEADLINE_EXCEEDED"));
  EXPECT_THAT(procs[0].out, HasSubstr("rank 2 of WORLD_SIZE=3 never connected"));
  EXPECT_THAT(procs[0].out, HasSubstr("rank 0 turned away 1 process: two processes have RANK=1"));
}

TEST_F(EnvBootstrap, ASecondRankZeroCannotListen) {
  // A second rank 0 cannot even listen; the first one and rank 1 run the job.
  std::vector<Proc> procs = {start(rank_env(0, 2))};
  const int probe = connect_when_listening(port_);
  ASSERT_GE(probe, 0) << "rank 0 never listened";
  ::close(probe);
  std::vector<Proc> second{start(rank_env(0, 2))};
  wait_all(second);
  procs.push_back(second[0]);
  procs.push_back(start(rank_env(1, 2)));
  wait_all(procs);
  EXPECT_EQ(procs[0].code, 0) << procs[0].out;  // the first rank 0 and rank 1 run the job
  EXPECT_EQ(procs[2].code, 0) << procs[2].out;
  EXPECT_EQ(procs[1].code, 3) << procs[1].out;
  EXPECT_THAT(procs[1].out, HasSubstr("error UNAVAILABLE: env bootstrap: rank 0 cannot listen "
                                      "on port " +
                                      std::to_string(port_) + " (MASTER_PORT)"));
  EXPECT_THAT(procs[1].out, HasSubstr("Address already in use"));
}

TEST_F(EnvBootstrap, ARankThatDiesFailsTheOthersAtOnce) {
  const auto t0 = Clock::now();
  auto procs = run_world(3, {"--exit-after", "2"}, 30);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 15)
      << "the survivors waited for the 30 s timeout instead of seeing the closed connection";
  EXPECT_EQ(procs[1].code, 0) << procs[1].out;
  EXPECT_THAT(procs[1].out, HasSubstr("exiting early after round 2"));
  for (const size_t r : {size_t{0}, size_t{2}}) {
    EXPECT_EQ(procs[r].code, 4) << procs[r].out;
    EXPECT_THAT(procs[r].out, HasSubstr("error UNAVAILABLE: bootstrap barrier #7: rank 1 closed "
                                        "its connection to rank 0"));
  }
  EXPECT_THAT(procs[2].out, HasSubstr("[reported to rank 2 of 3 by rank 0]"));
}

// abort_job under the env bootstrap ends the job's other processes on this host, a stopped
// one too (the launcher, a shell loop here, would otherwise wait for it forever).
TEST_F(EnvBootstrap, AbortJobEndsAStoppedRankOnThisHost) {
  const auto t0 = Clock::now();
  auto procs = run_world(3, {"--stop-at-end", "2", "--abort-at-end", "7"}, 30);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20);
  EXPECT_EQ(procs[0].code, 7) << procs[0].out;
  EXPECT_EQ(procs[2].code, -2) << "the stopped rank was not killed: " << procs[2].out;
  // Rank 1 has usually returned by then (0); if not, it was ended too (-2).
  EXPECT_TRUE(procs[1].code == 0 || procs[1].code == -2) << procs[1].out;
}

// MPI's exit handler (MPI_Finalize) waits for every rank; with one stopped it gives up after
// LOOM_BOOTSTRAP_TIMEOUT, saying so, and mpirun then ends the job.
TEST(MpiBootstrap, FinalizeDoesNotWaitForeverForAStoppedRank) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  loom_test::TempDir dir;
  const std::string log = (dir.path() / "mpi.log").string();
  const auto t0 = Clock::now();
  const int st =
      std::system(("LOOM_BOOTSTRAP_TIMEOUT=3 timeout -s KILL 60 " + std::string(LOOM_MPIRUN) +
                   " --oversubscribe --allow-run-as-root -np 2 " LOOM_BOOTSTRAP_PEER
                   " --rounds 2 --stop-at-end 1 > " +
                   log + " 2>&1")
                      .c_str());
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  std::ifstream f(log);
  std::stringstream out;
  out << f.rdbuf();
  EXPECT_LT(took, 30) << out.str();
  EXPECT_NE(WEXITSTATUS(st), 0) << out.str();
  EXPECT_THAT(out.str(), HasSubstr("rank 0: MPI_Finalize waited 3 s for the other ranks"));
}

TEST_F(EnvBootstrap, MismatchedCollectivesFailEveryRank) {
  auto procs = run_world(3, {"--mismatch"});
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 4) << p.out;
    // Round 1 is the second user call after the host-name exchange (#1) and round 0 (#2, #3).
    EXPECT_THAT(p.out, HasSubstr("error FAILED_PRECONDITION: bootstrap: the ranks' collectives "
                                 "do not match: rank 0 is in allgather #4 (1 bytes per rank) but "
                                 "rank 1 called allgather #4 (2 bytes per rank)"));
  }
}

TEST_F(EnvBootstrap, IncompleteOrMalformedVariablesAreNamed) {
  const std::string port = std::to_string(port_);
  EXPECT_THAT(fails_to_start({{"RANK", "1"}}),
              HasSubstr("error INVALID_ARGUMENT: env bootstrap: RANK is set but WORLD_SIZE, "
                        "MASTER_ADDR, MASTER_PORT are not (a torchrun-style launch sets"));
  EXPECT_THAT(fails_to_start({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}}),
              HasSubstr("MASTER_ADDR, MASTER_PORT are set but RANK, WORLD_SIZE are not"));
  Env e = rank_env(0, 2);
  e["RANK"] = "x1";
  EXPECT_THAT(fails_to_start(e), HasSubstr("RANK='x1' is not a whole number from 0 to"));
  e = rank_env(2, 2);
  EXPECT_THAT(fails_to_start(e), HasSubstr("RANK=2 is not below WORLD_SIZE=2 (ranks are 0 to 1)"));
  e = rank_env(0, 2);
  e["WORLD_SIZE"] = "0";
  EXPECT_THAT(fails_to_start(e), HasSubstr("WORLD_SIZE='0' is not a whole number from 1 to"));
  e = rank_env(0, 2);
  e["MASTER_PORT"] = "70000";
  EXPECT_THAT(fails_to_start(e),
              HasSubstr("MASTER_PORT='70000' is not a whole number from 1 to 65535"));
  e = rank_env(1, 2);
  e["LOCAL_RANK"] = "2";
  EXPECT_THAT(fails_to_start(e), HasSubstr("LOCAL_RANK='2' is not a whole number from 0 to 1"));
  e = rank_env(0, 2);
  e["LOOM_BOOTSTRAP_TIMEOUT"] = "soon";
  EXPECT_THAT(fails_to_start(e),
              HasSubstr("LOOM_BOOTSTRAP_TIMEOUT='soon' is not a number of seconds above 0"));
  e = rank_env(0, 2);
  e["LOOM_BOOTSTRAP"] = "tcp";
  EXPECT_THAT(fails_to_start(e), HasSubstr("LOOM_BOOTSTRAP='tcp' is not one of mpi, env, single"));
  EXPECT_THAT(fails_to_start({{"LOOM_BOOTSTRAP", "env"}}),
              HasSubstr("env bootstrap: none of the variables is set"));
  // A name that does not resolve is retried until the deadline (it may resolve later).
  e = rank_env(1, 2, 2);
  e["MASTER_ADDR"] = "no-such-host.invalid";
  const auto t0 = Clock::now();
  const std::string out = fails_to_start(e);
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - t0).count(), 1.9);
  EXPECT_THAT(out, HasSubstr("error DEADLINE_EXCEEDED: env bootstrap: rank 1 of 2 could not "
                             "reach rank 0 at no-such-host.invalid:"));
  EXPECT_THAT(out, HasSubstr("MASTER_ADDR 'no-such-host.invalid' does not resolve"));
  e = rank_env(1, 2);
  e["MASTER_ADDR"] = "[]";
  EXPECT_THAT(fails_to_start(e), HasSubstr("MASTER_ADDR='[]' is not a host name or address"));
}

// MASTER_ADDR may be a bracketed IPv6 address, as in a URL.
TEST_F(EnvBootstrap, ABracketedIpv6MasterAddrWorks) {
  const int probe = ::socket(AF_INET6, SOCK_STREAM, 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool has_v6 =
      probe >= 0 && ::bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;  // NOLINT
  if (probe >= 0) ::close(probe);
  if (!has_v6) GTEST_SKIP() << "no IPv6 loopback here";
  std::vector<Proc> procs;
  for (int r = 0; r < 2; ++r) {
    Env e = rank_env(r, 2);
    e["MASTER_ADDR"] = "[::1]";
    procs.push_back(start(e, {"--rounds", "2"}));
  }
  wait_all(procs);
  for (const Proc& p : procs) {
    EXPECT_EQ(p.code, 0) << p.out;
    EXPECT_THAT(p.out, HasSubstr("via [::1]:" + std::to_string(port_)));
  }
}

TEST_F(EnvBootstrap, SingleIgnoresTheVariables) {
  Env e = rank_env(1, 2);
  e["LOOM_BOOTSTRAP"] = "single";
  std::vector<Proc> one{start(e, {"--rounds", "2"})};
  wait_all(one);
  EXPECT_EQ(one[0].code, 0) << one[0].out;
  EXPECT_THAT(one[0].out, HasSubstr("how: a world of one"));
  EXPECT_THAT(one[0].out, HasSubstr("ok rank 0 of 1 local 0 rounds 2"));
}

}  // namespace
