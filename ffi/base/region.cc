#include "base/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace arx {

Region::~Region() {
  if (base_) munmap(base_, size_);
  unlink();
}

void Region::unlink() {
  if (owner_ && !name_.empty()) shm_unlink(name_.c_str());
  owner_ = false;
}

Status Region::create(uint64_t bytes, bool shared, std::unique_ptr<Region>& out) {
  std::unique_ptr<Region> r(new Region());
  r->size_ = bytes;
  if (!shared) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return Status::Error(strf("jax_arx: could not allocate %llu bytes for an endpoint: %s",
                                (unsigned long long)bytes, strerror(errno)));
    r->base_ = static_cast<uint8_t*>(p);
    out = std::move(r);
    return Status::Ok();
  }
  std::random_device rd;
  const std::string name = strf("/jax_arx-%d-%08x%08x", (int)getpid(), rd(), rd());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0)
    return Status::Error(strf("jax_arx: shm_open(%s) failed: %s; is /dev/shm mounted and writable?", name.c_str(),
                              strerror(errno)));
  r->name_ = name;
  r->owner_ = true;
  // posix_fallocate reserves every page now: a tmpfs that cannot hold the
  // region fails here with a clear error instead of a SIGBUS mid-collective.
  if (ftruncate(fd, (off_t)bytes) != 0 || (errno = posix_fallocate(fd, 0, (off_t)bytes)) != 0) {
    const int e = errno;
    close(fd);
    return Status::Error(strf("jax_arx: could not size shared memory %s to %llu bytes: %s; /dev/shm may be too "
                              "small (docker: --shm-size), or set JAX_ARX_TRANSPORT=tcp",
                              name.c_str(), (unsigned long long)bytes, strerror(e)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (p == MAP_FAILED)
    return Status::Error(strf("jax_arx: mmap of shared memory %s failed: %s", name.c_str(), strerror(e)));
  r->base_ = static_cast<uint8_t*>(p);
  out = std::move(r);
  return Status::Ok();
}

Status Region::open_peer(const std::string& name, uint64_t bytes, std::unique_ptr<Region>& out) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0)
    return Status::Error(strf("jax_arx: could not open a peer's shared memory %s: %s; the shm carrier needs every "
                              "rank on this host (set JAX_ARX_TRANSPORT=tcp across hosts)",
                              name.c_str(), strerror(errno)));
  struct stat st{};
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != bytes) {
    close(fd);
    return Status::Error(strf("jax_arx: peer shared memory %s has %lld bytes, expected %llu", name.c_str(),
                              (long long)st.st_size, (unsigned long long)bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (p == MAP_FAILED)
    return Status::Error(strf("jax_arx: mmap of peer shared memory %s failed: %s", name.c_str(), strerror(e)));
  std::unique_ptr<Region> r(new Region());
  r->base_ = static_cast<uint8_t*>(p);
  r->size_ = bytes;
  r->name_ = name;
  out = std::move(r);
  return Status::Ok();
}

}  // namespace arx
