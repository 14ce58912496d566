#include "base/windows.h"

#include <unistd.h>

#include "base/atomics.h"

namespace arx {
namespace {

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

}  // namespace

std::string PeerWindows::details(const Region& mine) { return mine.name() + '\n' + host_name(); }

Status PeerWindows::open(const std::vector<std::string>& details, int rank, const Layout& layout, Region& mine,
                         double timeout_s, const std::string& label) {
  const int world = (int)details.size();
  const std::string host = host_name();
  peers_.clear();
  peers_.resize(world);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    const std::string& d = details[j];
    const size_t nl = d.find('\n');
    if (nl == std::string::npos)
      return Status::Error(strf("jax_arx: %s: malformed shared-memory details from rank %d", label.c_str(), j));
    const std::string name = d.substr(0, nl), their_host = d.substr(nl + 1);
    if (their_host != host)
      return Status::Error(
          strf("jax_arx: %s: the shm carrier needs every rank on one host, but rank %d is on "
               "'%s' and this rank on '%s'; set JAX_ARX_TRANSPORT=tcp (or verbs)",
               label.c_str(), j, their_host.c_str(), host.c_str()));
    ARX_RETURN_IF_ERROR(Region::open_peer(name, layout.total, peers_[j]));
    // Tell rank j that its region is mapped here.
    store_release(reinterpret_cast<uint64_t*>(peers_[j]->base() + layout.handshake_offset(rank)), 1);
  }
  const auto deadline = deadline_in(timeout_s);
  for (int j = 0; j < world; ++j) {
    if (j == rank) continue;
    const uint64_t* word = reinterpret_cast<const uint64_t*>(mine.base() + layout.handshake_offset(j));
    if (wait_nonzero(word, deadline) == 0)
      return Status::Error(
          strf("jax_arx: %s: rank %d did not map this rank's shared memory within %g s", label.c_str(), j, timeout_s));
  }
  mine.unlink();
  mapped_ = true;
  return Status::Ok();
}

void PeerWindows::close() {
  peers_.clear();
  mapped_ = false;
}

}  // namespace arx
