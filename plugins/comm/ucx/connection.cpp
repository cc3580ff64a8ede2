// The ucx transport's connection setup and teardown: the UCP context and worker, the
// worker addresses exchanged through the host's bootstrap, one endpoint per peer, the
// connection check, the abort messages that make every rank fail together, and split,
// which makes a sub-communicator over a subset of those endpoints.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ucx.hpp"

namespace loom::plugins::ucx {

// ------------------------------------------------------------------------------- Link

Link::~Link() {
  if (worker != nullptr) {
    std::vector<void*> closing;
    for (ucp_ep_h& ep : eps) {
      if (ep == nullptr) continue;
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = force_close ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* r = ucp_ep_close_nbx(ep, &rp);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
      ep = nullptr;
    }
    const auto until = Clock::now() + std::chrono::duration<double>(close_timeout_s);
    while (!closing.empty() && Clock::now() < until) {
      ucp_worker_progress(worker);
      std::erase_if(closing, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
    }
    for (void* r : closing) ucp_request_free(r);
    ucp_worker_destroy(worker);
    worker = nullptr;
  }
  if (context != nullptr) {
    ucp_cleanup(context);
    context = nullptr;
  }
}

int Link::reserve_id() {
  const std::lock_guard lock(mu);
  for (int i = 1; i < kMaxComms; ++i) {
    if ((ids & (1ULL << i)) == 0) {
      ids |= 1ULL << i;
      return i;
    }
  }
  return -1;
}

void Link::release_id(int id) {
  if (id <= 0 || id >= kMaxComms) return;
  const std::lock_guard lock(mu);
  ids &= ~(1ULL << id);
}

SplitPlan::SplitPlan(SplitPlan&& o) noexcept
    : link(std::move(o.link)),
      rank(o.rank),
      world(std::move(o.world)),
      ids(std::move(o.ids)),
      id(std::exchange(o.id, 0)),
      epoch_sig(o.epoch_sig),
      timeout_s(o.timeout_s),
      small_bytes(o.small_bytes),
      chunk_bytes(o.chunk_bytes),
      depth(o.depth) {}

SplitPlan::~SplitPlan() {
  if (link != nullptr) link->release_id(id);
}

// -------------------------------------------------------------------------- creation

Ucx::Ucx(Context& ctx)
    : ctx_(ctx),
      rank_(ctx.rank()),
      size_(ctx.world_size()),
      timeout_s_(ctx.get_float("timeout_s")),
      small_bytes_(static_cast<std::size_t>(ctx.get_int("small_message_bytes"))),
      chunk_bytes_(static_cast<std::size_t>(ctx.get_int("chunk_bytes"))),
      depth_(static_cast<int>(ctx.get_int("pipeline_depth"))),
      link_(std::make_shared<Link>()) {
  if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "bootstrap gave rank " + std::to_string(rank_) + " of " + std::to_string(size_));
  }
  if (size_ > kMaxRanks) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "ucx supports up to " + std::to_string(kMaxRanks) + " ranks");
  }
  world_.resize(static_cast<std::size_t>(size_));
  for (int j = 0; j < size_; ++j) world_[static_cast<std::size_t>(j)] = j;
  ids_.assign(static_cast<std::size_t>(size_), 0);
  link_->close_timeout_s = std::min(timeout_s_, 10.0);
  if (size_ == 1) return;  // a world of one: collectives are local copies
  try {
    connect();
  } catch (...) {
    teardown(true);
    throw;
  }
}

Ucx::Ucx(Context& ctx, SplitPlan&& plan)
    : ctx_(ctx),
      rank_(plan.rank),
      size_(static_cast<int>(plan.world.size())),
      timeout_s_(plan.timeout_s),
      small_bytes_(plan.small_bytes),
      chunk_bytes_(plan.chunk_bytes),
      depth_(plan.depth),
      link_(std::move(plan.link)),
      world_(std::move(plan.world)),
      ids_(std::move(plan.ids)),
      id_(std::exchange(plan.id, 0)),  // the comm number is this instance's now
      root_(false),
      epoch_sig_(plan.epoch_sig) {
  if (size_ == 1) return;  // a group of one: collectives are local copies
  try {
    post_abort_recv();
  } catch (...) {
    teardown(true);
    throw;
  }
}

void Ucx::check_ucs(ucs_status_t st, const std::string& what) {
  if (st != UCS_OK) {
    throw Error(LOOM_ERR_UNAVAILABLE, what + ": " + ucs_status_string(st));
  }
}

void Ucx::on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* failed = static_cast<std::atomic<int>*>(arg);
  failed->store(static_cast<int>(status) == 0 ? -1 : static_cast<int>(status));
}

std::string Ucx::who(int r) const {
  std::string s = "rank " + std::to_string(r);
  if (!root_ && r >= 0 && r < size_) {
    s += " (world rank " + std::to_string(world_[static_cast<std::size_t>(r)]) + ")";
  }
  return s;
}

void Ucx::connect() {
  Link& l = *link_;
  ucp_config_t* config = nullptr;
  check_ucs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG;
  params.estimated_num_eps = static_cast<std::size_t>(size_);
  const ucs_status_t st = ucp_init(&params, config, &l.context);
  ucp_config_release(config);
  check_ucs(st, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // [instance]: one call at a time, but not always from the creating thread.
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  check_ucs(ucp_worker_create(l.context, &wp, &l.worker), "ucp_worker_create");
  ucp_address_t* address = nullptr;
  std::size_t address_len = 0;
  check_ucs(ucp_worker_get_address(l.worker, &address, &address_len), "ucp_worker_get_address");
  // Two bootstrap rounds: every rank's address length, then the addresses padded to the
  // longest.
  const auto p = static_cast<std::size_t>(size_);
  std::vector<uint64_t> hdr(2 * p);  // per rank: address length, epoch proposal
  std::random_device entropy;
  const uint64_t mine[2] = {address_len,
                            mix((static_cast<uint64_t>(entropy()) << 32) ^ entropy() ^
                                static_cast<uint64_t>(Clock::now().time_since_epoch().count()))};
  std::vector<unsigned char> all;
  std::size_t longest = 0;
  try {
    ctx_.bootstrap_allgather(mine, sizeof(mine), hdr.data());
    l.epoch = hdr[1];  // rank 0's
    epoch_sig_ = mix(l.epoch) & kSigMask;
    for (std::size_t j = 0; j < p; ++j) longest = std::max<std::size_t>(longest, hdr[2 * j]);
    std::vector<unsigned char> padded(longest, 0);
    std::memcpy(padded.data(), address, address_len);
    all.resize(longest * p);
    ctx_.bootstrap_allgather(padded.data(), longest, all.data());
  } catch (...) {
    ucp_worker_release_address(l.worker, address);
    throw;
  }
  ucp_worker_release_address(l.worker, address);
  l.eps.assign(p, nullptr);
  l.ep_failed = std::vector<std::atomic<int>>(p);
  for (std::size_t j = 0; j < p; ++j) {
    if (static_cast<int>(j) == rank_) continue;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(all.data() + j * longest);
    // Default error mode: UCP_ERR_HANDLING_MODE_PEER gave spurious "Endpoint timeout" errors
    // between healthy ranks with UCX 1.13 here (docs/comm.md); a dead peer is caught by
    // timeout_s instead. The handler still records any error UCX reports.
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ep.err_handler.cb = &on_ep_error;
    ep.err_handler.arg = &l.ep_failed[j];
    check_ucs(ucp_ep_create(l.worker, &ep, &l.eps[j]),
              "ucp_ep_create to rank " + std::to_string(j));
  }
  post_abort_recv();
  // Every peer answers (and the endpoints are wired up) before the first collective.
  Round rd(*this, kKindHello, 0, 0, "connection setup");
  dissemination(rd);
}

void Ucx::post_abort_recv() {
  const std::lock_guard lock(link_->mu);
  ucp_request_param_t rp{};
  abort_req_ = ucp_tag_recv_nbx(
      link_->worker, abort_in_, kAbortBytes,
      make_tag(kKindAbort, link_->epoch, static_cast<uint64_t>(id_), 0, 0, 0, 0), kAbortMask, &rp);
  if (UCS_PTR_IS_ERR(abort_req_)) {
    const ucs_status_t st = UCS_PTR_STATUS(abort_req_);
    abort_req_ = nullptr;
    check_ucs(st, "posting the abort receive");
  }
}

// Throws the error a peer reported, if one arrived.
void Ucx::check_abort() {
  if (abort_req_ == nullptr) return;
  const std::lock_guard lock(link_->mu);
  ucp_tag_recv_info_t info{};
  const ucs_status_t st = ucp_tag_recv_request_test(abort_req_, &info);
  if (st == UCS_INPROGRESS) return;
  ucp_request_free(abort_req_);
  abort_req_ = nullptr;
  int32_t code = LOOM_ERR_INTERNAL;
  int32_t from = -1;
  uint64_t epoch = 0;
  std::string text = "(unreadable abort message)";
  if (st == UCS_OK && info.length >= kAbortHeader) {
    std::memcpy(&code, abort_in_, 4);
    std::memcpy(&from, abort_in_ + 4, 4);
    std::memcpy(&epoch, abort_in_ + 8, 8);
    text.assign(abort_in_ + kAbortHeader,
                abort_in_ + std::min<std::size_t>(info.length, kAbortBytes));
    if (epoch != link_->epoch) {  // from an earlier instance whose tag epoch collided: ignore
      post_abort_recv();
      return;
    }
  }
  if (code <= LOOM_OK || code > LOOM_ERR_INTERNAL) code = LOOM_ERR_INTERNAL;
  throw PeerAbort(static_cast<loom_code>(code), who(from) + " failed the collective: " + text);
}

void Ucx::send_abort(loom_code code, const std::string& message) noexcept {
  if (link_ == nullptr || link_->worker == nullptr) return;
  const std::lock_guard lock(link_->mu);
  const int32_t c = code;
  const int32_t me = rank_;
  std::memcpy(abort_out_, &c, 4);
  std::memcpy(abort_out_ + 4, &me, 4);
  std::memcpy(abort_out_ + 8, &link_->epoch, 8);
  const std::size_t len = std::min(message.size(), kAbortBytes - kAbortHeader);
  std::memcpy(abort_out_ + kAbortHeader, message.data(), len);
  std::vector<void*> reqs;
  for (std::size_t j = 0; j < world_.size(); ++j) {
    const auto w = static_cast<std::size_t>(world_[j]);
    if (link_->eps[w] == nullptr || link_->ep_failed[w].load() != 0) continue;
    ucp_request_param_t rp{};
    void* r = ucp_tag_send_nbx(link_->eps[w], abort_out_, kAbortHeader + len,
                               make_tag(kKindAbort, link_->epoch, ids_[j], seq_, 0, 0, 0), &rp);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) reqs.push_back(r);
  }
  // Best effort: give the messages a moment to leave, without waiting on dead peers.
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  while (!reqs.empty() && Clock::now() < until) {
    ucp_worker_progress(link_->worker);
    std::erase_if(reqs, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  for (void* r : reqs) ucp_request_free(r);  // completes in the background or at close
}

void Ucx::teardown(bool force) noexcept {
  if (link_ == nullptr) return;
  {
    const std::lock_guard lock(link_->mu);
    if (abort_req_ != nullptr) {
      ucp_request_cancel(link_->worker, abort_req_);
      ucp_request_free(abort_req_);
      abort_req_ = nullptr;
    }
    if (force) link_->force_close = true;
  }
  link_->release_id(id_);
  id_ = 0;
  link_.reset();  // the last communicator on the link closes it
}

// ------------------------------------------------------------------------------- split

std::optional<SplitPlan> Ucx::split(int32_t color, int32_t key) {
  usable();
  const bool member = color >= 0;
  SplitPlan plan;  // owns the comm number reserved here until the child takes it
  plan.link = link_;
  if (member && size_ > 1) plan.id = link_->reserve_id();  // -1: none free on this rank
  // Every rank's color, key and comm number for its group, through this instance.
  const auto p = static_cast<std::size_t>(size_);
  const auto me = static_cast<std::size_t>(rank_);
  std::vector<int64_t> all(4 * p, 0);
  all[4 * me] = member ? color : -1;
  all[4 * me + 1] = key;
  all[4 * me + 2] = plan.id;
  rounds_.fetch_add(1, std::memory_order_relaxed);
  if (size_ > 1) {
    collective(signature(6, 0, 0, 4), "split", [&](Round& rd) {
      ring_allgather(rd, reinterpret_cast<char*>(all.data()), 4, sizeof(int64_t));
    });
  }
  if (!member) return std::nullopt;
  std::vector<int> group;
  for (std::size_t j = 0; j < p; ++j) {
    if (all[4 * j] == color) group.push_back(static_cast<int>(j));
  }
  std::sort(group.begin(), group.end(), [&](int a, int b) {
    const int64_t ka = all[4 * static_cast<std::size_t>(a) + 1];
    const int64_t kb = all[4 * static_cast<std::size_t>(b) + 1];
    return ka != kb ? ka < kb : a < b;
  });
  if (group.size() > 1) {
    // Every rank of the group sees the same table, so all of them fail alike.
    for (int j : group) {
      if (all[4 * static_cast<std::size_t>(j) + 2] < 0) {
        throw Error(LOOM_ERR_RESOURCE_EXHAUSTED,
                    "split: " + who(j) + " already has " + std::to_string(kMaxComms - 1) +
                        " sub-communicators of this ucx transport open (the most one process "
                        "can have); destroy some before splitting again");
      }
    }
  } else {
    link_->release_id(plan.id);  // a group of one sends nothing
    plan.id = 0;
  }
  for (std::size_t i = 0; i < group.size(); ++i) {
    const auto j = static_cast<std::size_t>(group[i]);
    if (j == me) plan.rank = static_cast<int>(i);
    plan.world.push_back(world_[j]);
    plan.ids.push_back(static_cast<uint32_t>(std::max<int64_t>(0, all[4 * j + 2])));
  }
  // Messages of an earlier communicator that had the same comm numbers fail the signature
  // check instead of matching (the epoch does the same for instances).
  plan.epoch_sig =
      mix(epoch_sig_ ^ mix((seq_ << 32) ^ static_cast<uint64_t>(static_cast<uint32_t>(color)))) &
      kSigMask;
  plan.timeout_s = timeout_s_;
  plan.small_bytes = small_bytes_;
  plan.chunk_bytes = chunk_bytes_;
  plan.depth = depth_;
  return std::optional<SplitPlan>(std::move(plan));
}

}  // namespace loom::plugins::ucx
