// The ucx transport's connection setup and teardown: the UCP context and worker, the
// worker addresses exchanged through the host's bootstrap, one endpoint per peer, the
// connection check, and the abort messages that make every rank fail together.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ucx.hpp"

namespace loom::plugins::ucx {

Ucx::Ucx(Context& ctx)
    : ctx_(ctx),
      rank_(ctx.rank()),
      size_(ctx.world_size()),
      timeout_s_(ctx.get_float("timeout_s")),
      small_bytes_(static_cast<std::size_t>(ctx.get_int("small_message_bytes"))),
      chunk_bytes_(static_cast<std::size_t>(ctx.get_int("chunk_bytes"))),
      depth_(static_cast<int>(ctx.get_int("pipeline_depth"))) {
  if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "bootstrap gave rank " + std::to_string(rank_) + " of " + std::to_string(size_));
  }
  if (size_ > kMaxRanks) {
    throw Error(LOOM_ERR_UNIMPLEMENTED,
                "ucx supports up to " + std::to_string(kMaxRanks) + " ranks");
  }
  if (size_ == 1) return;  // a world of one: collectives are local copies
  try {
    connect();
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

void Ucx::connect() {
  ucp_config_t* config = nullptr;
  check_ucs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG;
  params.estimated_num_eps = static_cast<std::size_t>(size_);
  const ucs_status_t st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  check_ucs(st, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // [instance]: one call at a time, but not always from the creating thread.
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  check_ucs(ucp_worker_create(context_, &wp, &worker_), "ucp_worker_create");
  ucp_address_t* address = nullptr;
  std::size_t address_len = 0;
  check_ucs(ucp_worker_get_address(worker_, &address, &address_len), "ucp_worker_get_address");
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
    epoch_ = hdr[1];  // rank 0's
    epoch_sig_ = mix(epoch_) & kSigMask;
    for (std::size_t j = 0; j < p; ++j) longest = std::max<std::size_t>(longest, hdr[2 * j]);
    std::vector<unsigned char> padded(longest, 0);
    std::memcpy(padded.data(), address, address_len);
    all.resize(longest * p);
    ctx_.bootstrap_allgather(padded.data(), longest, all.data());
  } catch (...) {
    ucp_worker_release_address(worker_, address);
    throw;
  }
  ucp_worker_release_address(worker_, address);
  eps_.assign(p, nullptr);
  ep_failed_ = std::vector<std::atomic<int>>(p);
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
    ep.err_handler.arg = &ep_failed_[j];
    check_ucs(ucp_ep_create(worker_, &ep, &eps_[j]), "ucp_ep_create to rank " + std::to_string(j));
  }
  post_abort_recv();
  // Every peer answers (and the endpoints are wired up) before the first collective.
  Round rd(*this, kKindHello, 0, 0, "connection setup");
  dissemination(rd);
}

void Ucx::post_abort_recv() {
  ucp_request_param_t rp{};
  abort_req_ = ucp_tag_recv_nbx(worker_, abort_in_, kAbortBytes,
                                make_tag(kKindAbort, epoch_, 0, 0, 0, 0), kAbortMask, &rp);
  if (UCS_PTR_IS_ERR(abort_req_)) {
    const ucs_status_t st = UCS_PTR_STATUS(abort_req_);
    abort_req_ = nullptr;
    check_ucs(st, "posting the abort receive");
  }
}

// Throws the error a peer reported, if one arrived.
void Ucx::check_abort() {
  if (abort_req_ == nullptr) return;
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
    if (epoch != epoch_) {  // from an earlier instance whose tag epoch collided: ignore
      post_abort_recv();
      return;
    }
  }
  if (code <= LOOM_OK || code > LOOM_ERR_INTERNAL) code = LOOM_ERR_INTERNAL;
  throw PeerAbort(static_cast<loom_code>(code),
                  "rank " + std::to_string(from) + " failed the collective: " + text);
}

void Ucx::send_abort(loom_code code, const std::string& message) noexcept {
  if (worker_ == nullptr) return;
  const int32_t c = code;
  const int32_t me = rank_;
  std::memcpy(abort_out_, &c, 4);
  std::memcpy(abort_out_ + 4, &me, 4);
  std::memcpy(abort_out_ + 8, &epoch_, 8);
  const std::size_t len = std::min(message.size(), kAbortBytes - kAbortHeader);
  std::memcpy(abort_out_ + kAbortHeader, message.data(), len);
  std::vector<void*> reqs;
  for (std::size_t j = 0; j < eps_.size(); ++j) {
    if (eps_[j] == nullptr || ep_failed_[j].load() != 0) continue;
    ucp_request_param_t rp{};
    void* r = ucp_tag_send_nbx(eps_[j], abort_out_, kAbortHeader + len,
                               make_tag(kKindAbort, epoch_, seq_, 0, 0, 0), &rp);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) reqs.push_back(r);
  }
  // Best effort: give the messages a moment to leave, without waiting on dead peers.
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  while (!reqs.empty() && Clock::now() < until) {
    ucp_worker_progress(worker_);
    std::erase_if(reqs, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  for (void* r : reqs) ucp_request_free(r);  // completes in the background or at close
}

void Ucx::teardown(bool force) noexcept {
  if (worker_ != nullptr) {
    if (abort_req_ != nullptr) {
      ucp_request_cancel(worker_, abort_req_);
      ucp_request_free(abort_req_);
      abort_req_ = nullptr;
    }
    std::vector<void*> closing;
    for (ucp_ep_h& ep : eps_) {
      if (ep == nullptr) continue;
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* r = ucp_ep_close_nbx(ep, &rp);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
      ep = nullptr;
    }
    const auto until = Clock::now() + std::chrono::duration<double>(std::min(timeout_s_, 10.0));
    while (!closing.empty() && Clock::now() < until) {
      ucp_worker_progress(worker_);
      std::erase_if(closing, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
    }
    for (void* r : closing) ucp_request_free(r);
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (context_ != nullptr) {
    ucp_cleanup(context_);
    context_ = nullptr;
  }
}

}  // namespace loom::plugins::ucx
