// The memory of one endpoint (see layout.h), or a peer's, mapped here.
// A region is anonymous memory, or, for the shm carrier, a POSIX shared
// memory object that peers on this host map by name. Device sides that
// need the memory pinned or registered (CUDA, verbs) do that on top.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"

namespace arx {

class Region {
 public:
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // New zeroed memory of `bytes`. shared: a named shm object peers can map.
  static Status create(uint64_t bytes, bool shared, std::unique_ptr<Region>& out);
  // Maps a peer's shared region by the name it advertised.
  static Status open_peer(const std::string& name, uint64_t bytes, std::unique_ptr<Region>& out);

  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name (the mapping stays): done once every peer mapped it,
  // so nothing is left in /dev/shm when a process dies later.
  void unlink();

 private:
  Region() = default;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::string name_;
  bool owner_ = false;
};

}  // namespace arx
