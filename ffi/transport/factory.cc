// The carriers by kind: the one place that names them all.
#include "transport/transport.h"

namespace arx {

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kShm:
      return "shm";
    case TransportKind::kTcp:
      return "tcp";
    case TransportKind::kVerbs:
      return "verbs";
  }
  return "unknown";
}

Status make_transport(TransportKind kind, const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  switch (kind) {
    case TransportKind::kShm:
      return make_shm_transport(ctx, out);
    case TransportKind::kTcp:
      return make_tcp_transport(ctx, out);
    case TransportKind::kVerbs:
      return make_verbs_transport(ctx, out);
  }
  return Status::Error("jax_arx: unknown carrier");
}

}  // namespace arx
