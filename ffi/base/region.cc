#include "base/region.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

extern char** environ;

namespace arx {

namespace {

// Starts the guard of shm object `name` (see region.h): it exits quietly
// when it reads a line, and removes the name when it reads end-of-file
// instead, i.e. when this process is gone. Returns false, leaving pid and fd
// at -1, where it cannot be started (no /bin/sh): the region then works,
// unguarded, as before.
bool start_guard(const std::string& name, int& pid, int& fd) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return false;
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&fa);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_adddup2(&fa, p[0], 0);  // dup2 clears close-on-exec on fd 0
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  posix_spawn_file_actions_addclosefrom_np(&fa, 3);  // hold none of the caller's other files open
#endif
  // Its own session: Ctrl-C in a terminal, or a launcher's killpg() of the
  // job, must not take the guard down with the process it guards.
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK);
  // $0 is the name without its leading '/': glibc keeps "/name" as /dev/shm/name.
  const std::string file = name.substr(1);
  const char* argv[] = {"sh", "-c",
                        "trap '' HUP INT TERM QUIT PIPE; if read -r _; then exit 0; fi; rm -f -- \"/dev/shm/$0\"",
                        file.c_str(), nullptr};
  pid_t child = -1;
  const int rc = posix_spawn(&child, "/bin/sh", &fa, &attr, const_cast<char**>(argv), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  close(p[0]);
  if (rc != 0) {
    close(p[1]);
    return false;
  }
  pid = child;
  fd = p[1];
  return true;
}

// Tells the guard the name is gone (a line on its pipe), then reaps it,
// waiting at most a second: it exits as soon as it has read the line.
void stop_guard(int& pid, int& fd) {
  if (fd >= 0) {
    while (write(fd, "\n", 1) < 0 && errno == EINTR) {
    }
    close(fd);
    fd = -1;
  }
  if (pid <= 0) return;
  for (int i = 0; i < 1000; ++i) {
    const pid_t r = waitpid(pid, nullptr, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) break;  // reaped, or not ours to reap (SIGCHLD ignored)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  pid = -1;
}

}  // namespace

Region::~Region() {
  if (base_) munmap(base_, size_);
  unlink();
}

void Region::unlink() {
  if (owner_ && !name_.empty()) shm_unlink(name_.c_str());
  owner_ = false;
  stop_guard(guard_pid_, guard_fd_);
}

Status Region::create(uint64_t bytes, bool shared, std::unique_ptr<Region>& out) {
  std::unique_ptr<Region> r(new Region());
  r->size_ = bytes;
  if (!shared) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return Status::Error(strf("jax_arx: could not allocate %llu bytes for an endpoint: %s", (unsigned long long)bytes,
                                strerror(errno)));
    r->base_ = static_cast<uint8_t*>(p);
    out = std::move(r);
    return Status::Ok();
  }
  std::random_device rd;
  const std::string name = strf("/jax_arx-%d-%08x%08x", (int)getpid(), rd(), rd());
  // The guard first: from the moment the name exists, some process will remove it.
  start_guard(name, r->guard_pid_, r->guard_fd_);
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0)
    return Status::Error(
        strf("jax_arx: shm_open(%s) failed: %s; is /dev/shm mounted and writable?", name.c_str(), strerror(errno)));
  r->name_ = name;
  r->owner_ = true;
  // posix_fallocate reserves every page now: a tmpfs that cannot hold the
  // region fails here with a clear error instead of a SIGBUS mid-collective.
  if (ftruncate(fd, (off_t)bytes) != 0 || (errno = posix_fallocate(fd, 0, (off_t)bytes)) != 0) {
    const int e = errno;
    close(fd);
    return Status::Error(
        strf("jax_arx: could not size shared memory %s to %llu bytes: %s; /dev/shm may be too "
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
    return Status::Error(
        strf("jax_arx: could not open a peer's shared memory %s: %s; the shm carrier needs every "
             "rank on this host (set JAX_ARX_TRANSPORT=tcp across hosts)",
             name.c_str(), strerror(errno)));
  struct stat st {};
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
