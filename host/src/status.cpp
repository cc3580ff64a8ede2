#include "status.hpp"

#include <cstring>
#include <new>

namespace loom::host {
namespace {

struct HostStatus {
  loom_status base;
  std::string text;
};

void destroy_host_status(loom_status* self) {
  // base is the first member, so the pointer is the HostStatus's.
  delete reinterpret_cast<HostStatus*>(
      self);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
}

}  // namespace

loom_status* make_status(int32_t code, const char* message) {
  if (code == LOOM_OK) return nullptr;
  auto* s = new (std::nothrow) HostStatus{};
  if (s == nullptr) {
    // Out of memory: a static status whose destroy does nothing still carries the code.
    static loom_status oom{LOOM_STATUS_SIZE, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory",
                           [](loom_status*) {}};
    return &oom;
  }
  s->text = message != nullptr ? message : "";
  s->base.struct_size = LOOM_STATUS_SIZE;
  s->base.code = code;
  s->base.message = s->text.c_str();
  s->base.destroy = destroy_host_status;
  return &s->base;
}

TakenStatus take_status(loom_status* status) {
  TakenStatus out;
  if (status == nullptr) return out;
  // Read only the fields the status's own size says exist.
  const uint32_t size = status->struct_size;
  out.code = size >= offsetof(loom_status, code) + sizeof(int32_t)
                 ? static_cast<loom_code>(status->code)
                 : LOOM_ERR_INTERNAL;
  if (out.code == LOOM_OK) out.code = LOOM_ERR_INTERNAL;  // a status object is an error
  const char* msg =
      size >= offsetof(loom_status, message) + sizeof(char*) ? status->message : nullptr;
  out.message = msg != nullptr ? msg : "(no message)";
  if (out.message.empty()) out.message = "(no message)";
  if (size >= LOOM_STATUS_SIZE && status->destroy != nullptr) status->destroy(status);
  return out;
}

}  // namespace loom::host
