// The memory of one endpoint (see layout.h), or a peer's, mapped here.
// A region is anonymous memory, or, for the shm carrier, a POSIX shared
// memory object that peers on this host map by name. Device sides that
// need the memory pinned or registered (CUDA, verbs) do that on top.
//
// A name in /dev/shm outlives every process that dies before removing it
// (SIGKILL, a crash, os._exit after a failed initialize): each named
// region therefore has a guard, a small child process (/bin/sh, in its own
// session, so a terminal's signals do not reach it) that holds the read end
// of a pipe whose write end only this process holds. unlink() tells the
// guard it is done and reaps it; if this process ends first, the guard
// reads end-of-file and removes the name.
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
  // so nothing is left in /dev/shm when a process dies later. Ends the guard.
  void unlink();
  // The guard's process id (-1: none); for tests.
  int guard_pid() const { return guard_pid_; }

 private:
  Region() = default;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::string name_;
  bool owner_ = false;
  int guard_pid_ = -1, guard_fd_ = -1;  // the guard, and the write end of its pipe
};

}  // namespace arx
