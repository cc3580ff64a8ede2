// The ucx transport's per-call bookkeeping: one Round per collective posts its sends and
// receives with the call's tags, matches what arrives against the call (signature, length),
// drives UCX's progress and enforces timeout_s.
#include <sched.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "ucx.hpp"

namespace loom::plugins::ucx {

std::string seconds_string(double s) {
  std::string t = std::to_string(s);
  while (!t.empty() && t.back() == '0') t.pop_back();
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t;
}

Round::Round(Ucx& t, uint64_t kind, uint64_t seq, uint64_t sig, std::string what)
    : t_(t), kind_(kind), seq_(seq), sig_(sig), what_(std::move(what)), last_event_(Clock::now()) {}

Round::~Round() {
  // Normal completion leaves nothing pending. On an error, receives are cancelled (their
  // buffers are the caller's); sends cannot be cancelled and complete or fail at close.
  const std::lock_guard lock(t_.link_->mu);
  for (Slot& s : slots_) {
    if (s.done || s.request == nullptr) continue;
    if (s.is_recv) ucp_request_cancel(t_.link_->worker, s.request);
  }
  const auto until = Clock::now() + std::chrono::milliseconds(200);
  bool pending = true;
  while (pending && Clock::now() < until) {
    pending = false;
    for (Slot& s : slots_) {
      if (s.done || s.request == nullptr || !s.is_recv) continue;
      if (ucp_request_check_status(s.request) == UCS_INPROGRESS) pending = true;
    }
    if (pending) ucp_worker_progress(t_.link_->worker);
  }
  for (Slot& s : slots_) {
    if (!s.done && s.request != nullptr) ucp_request_free(s.request);
  }
}

std::size_t Round::send(int peer, const void* data, std::size_t bytes, int step, uint64_t chunk,
                        uint64_t sig) {
  Slot slot;
  slot.peer = peer;
  slot.bytes = bytes;
  slot.step = step;
  slot.sig = ((sig == kUseCallSig ? sig_ : sig) ^ t_.epoch_sig_) & kSigMask;
  const auto p = static_cast<std::size_t>(peer);
  const std::lock_guard lock(t_.link_->mu);
  ucp_request_param_t rp{};
  void* r = ucp_tag_send_nbx(t_.link_->eps[static_cast<std::size_t>(t_.world_[p])], data, bytes,
                             make_tag(kind_, t_.link_->epoch, t_.ids_[p], seq_,
                                      static_cast<uint64_t>(step), chunk, slot.sig),
                             &rp);
  if (UCS_PTR_IS_ERR(r)) {
    transport_error(what_ + ": sending to " + t_.who(peer) +
                    " failed: " + ucs_status_string(UCS_PTR_STATUS(r)));
  }
  slot.request = r;
  slot.done = r == nullptr;
  if (slot.done) t_.bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
  slots_.push_back(slot);
  return slots_.size() - 1;
}

std::size_t Round::recv(int peer, void* data, std::size_t bytes, int step, uint64_t chunk,
                        uint64_t sig) {
  Slot slot;
  slot.peer = peer;
  slot.bytes = bytes;
  slot.step = step;
  slot.is_recv = true;
  slot.sig = ((sig == kUseCallSig ? sig_ : sig) ^ t_.epoch_sig_) & kSigMask;
  // Always a request (no immediate completion), so test() reads the sender's tag.
  const std::lock_guard lock(t_.link_->mu);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  void* r = ucp_tag_recv_nbx(t_.link_->worker, data, bytes,
                             make_tag(kind_, t_.link_->epoch, static_cast<uint64_t>(t_.id_), seq_,
                                      static_cast<uint64_t>(step), chunk, 0),
                             ~kSigMask, &rp);
  if (UCS_PTR_IS_ERR(r)) {
    transport_error(what_ + ": receiving from " + t_.who(peer) +
                    " failed: " + ucs_status_string(UCS_PTR_STATUS(r)));
  }
  slot.request = r;
  slots_.push_back(slot);
  return slots_.size() - 1;
}

void Round::transport_error(const std::string& message) {
  const auto until = Clock::now() + std::chrono::milliseconds(300);
  while (kind_ != kKindHello && Clock::now() < until) {
    {
      const std::lock_guard lock(t_.link_->mu);
      ucp_worker_progress(t_.link_->worker);
    }
    t_.check_abort();  // throws the peer's error when it has arrived
  }
  throw Error(LOOM_ERR_UNAVAILABLE, message);
}

void Round::mismatch(const Slot& s, const std::string& detail) {
  throw Error(LOOM_ERR_INVALID_ARGUMENT,
              what_ + ": " + t_.who(s.peer) + " does not agree with " + t_.who(t_.rank_) + " (" +
                  detail +
                  "): every rank must make the same collective call with the same dtype, "
                  "op and element count; this rank called " +
                  what_);
}

bool Round::test(std::size_t i) {
  Slot& s = slots_[i];
  if (s.done) return true;
  const std::lock_guard lock(t_.link_->mu);
  if (!s.is_recv) {
    const ucs_status_t st = ucp_request_check_status(s.request);
    if (st == UCS_INPROGRESS) return false;
    ucp_request_free(s.request);
    s.request = nullptr;
    s.done = true;
    if (st != UCS_OK) {
      transport_error(what_ + ": sending to " + t_.who(s.peer) +
                      " failed: " + ucs_status_string(st));
    }
    t_.bytes_sent_.fetch_add(s.bytes, std::memory_order_relaxed);
    last_event_ = Clock::now();
    return true;
  }
  ucp_tag_recv_info_t info{};
  const ucs_status_t st = ucp_tag_recv_request_test(s.request, &info);
  if (st == UCS_INPROGRESS) return false;
  ucp_request_free(s.request);
  s.request = nullptr;
  s.done = true;
  if (st == UCS_ERR_MESSAGE_TRUNCATED) mismatch(s, "its message is longer than expected");
  if (st != UCS_OK) {
    transport_error(what_ + ": receiving from " + t_.who(s.peer) +
                    " failed: " + ucs_status_string(st));
  }
  if ((info.sender_tag & kSigMask) != s.sig) mismatch(s, "its call differs");
  if (info.length != s.bytes) {
    mismatch(s, "it sent " + std::to_string(info.length) + " bytes where " +
                    std::to_string(s.bytes) + " were expected");
  }
  t_.bytes_received_.fetch_add(s.bytes, std::memory_order_relaxed);
  last_event_ = Clock::now();
  return true;
}

void Round::progress() {
  unsigned events = 0;
  {
    const std::lock_guard lock(t_.link_->mu);
    while (ucp_worker_progress(t_.link_->worker) != 0) ++events;
  }
  // Nothing to do: let the other ranks run (they may share this core); after a quiet spell,
  // sleep a little, so that a collective running in the background (started, ABI 1.6) leaves
  // the core to the computation it overlaps instead of taking half of it with yields.
  if (events == 0) {
    if (Clock::now() - last_event_ > std::chrono::microseconds(200)) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      sched_yield();
    }
  }
  // A peer may already have failed the first collective while this rank still finishes
  // its connection setup: that abort is for the collective, so it waits until then.
  if (kind_ != kKindHello) t_.check_abort();
  for (int j = 0; j < t_.size_; ++j) {
    if (j == t_.rank_) continue;
    const int f =
        t_.link_->ep_failed[static_cast<std::size_t>(t_.world_[static_cast<std::size_t>(j)])]
            .load();
    if (f != 0) {
      transport_error(what_ + ": the connection to " + t_.who(j) + " failed (" +
                      ucs_status_string(static_cast<ucs_status_t>(f)) + "); did it exit?");
    }
  }
  const double idle = std::chrono::duration<double>(Clock::now() - last_event_).count();
  if (idle < t_.timeout_s_) return;
  // Name the peer we wait for: a pending receive first (its sender is silent).
  const Slot* late = nullptr;
  for (const Slot& s : slots_) {
    if (s.done) continue;
    if (late == nullptr || (s.is_recv && !late->is_recv)) late = &s;
  }
  const std::string peer = late != nullptr ? t_.who(late->peer) : "rank ?";
  throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
              what_ + ": " + t_.who(t_.rank_) + " waited " + seconds_string(t_.timeout_s_) +
                  " s for " + peer + " (step " + std::to_string(late != nullptr ? late->step : 0) +
                  ") without progress: did it fail, exit or make a different call? "
                  "(timeout_s sets the limit)");
}

}  // namespace loom::plugins::ucx
