// Peers on one host: their regions, mapped in this process. Every rank of
// a communicator whose members share a host maps every peer's region
// (POSIX shared memory, base/region.h), so that a put is a store: the shm
// carrier's copies, and the direct channels of both device sides (comm/
// channel.h), go through these mappings.
//
// Set-up: each rank advertises its region's name and its host (details());
// open() maps every peer's, tells each peer so (a word of the peer's
// handshake page), and waits until every peer has mapped this rank's; then
// the name is removed, so a process that dies later leaves nothing in
// /dev/shm.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/layout.h"
#include "base/region.h"
#include "base/status.h"

namespace arx {

class PeerWindows {
 public:
  // What this rank tells its peers: its region's name and its host.
  static std::string details(const Region& mine);
  // Maps every peer's region from everyone's details (index = rank), or
  // fails naming the peer (another host, a region of another size, no answer
  // within timeout_s).
  Status open(const std::vector<std::string>& details, int rank, const Layout& layout, Region& mine, double timeout_s,
              const std::string& label);
  bool mapped() const { return mapped_; }
  // Peer `j`'s region as mapped here; null for this rank, or before open().
  uint8_t* base(int j) const { return j >= 0 && j < (int)peers_.size() && peers_[j] ? peers_[j]->base() : nullptr; }
  // Unmaps every peer (only once nothing uses the mappings any more).
  void close();

 private:
  std::vector<std::unique_ptr<Region>> peers_;
  bool mapped_ = false;
};

}  // namespace arx
