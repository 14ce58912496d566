// Shared regions leave nothing in /dev/shm, however their process ends
// (comm/region.h, "guard"):
//  - unlink() removes the name and reaps the guard; so does the destructor;
//  - a process killed with SIGKILL while it holds a named region, and one
//    that ends with _exit() (no destructors: os._exit after a failed
//    initialize), leave no name behind once they are gone;
//  - the guard ignores the signals a terminal or a launcher sends the job.
// Returns non-zero on failure.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "base/region.h"
#include "rig.h"

using namespace arx;
using namespace arx::testing;
using Clock = std::chrono::steady_clock;

namespace {

bool exists(const std::string& name) {
  struct stat st;
  return stat(("/dev/shm" + name).c_str(), &st) == 0;
}

// Polls until the name is gone, for up to timeout_s (the guard acts after
// the process is gone, asynchronously).
bool gone_within(const std::string& name, double timeout_s) {
  const auto t0 = Clock::now();
  while (exists(name)) {
    if (std::chrono::duration<double>(Clock::now() - t0).count() > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

bool running(int pid) { return pid > 0 && kill(pid, 0) == 0; }

void test_in_process() {
  const int f0 = g_failures;
  std::unique_ptr<Region> r;
  Status s = Region::create(1 << 20, /*shared=*/true, r);
  EXPECT(s.ok(), "create: %s", s.message().c_str());
  if (!s.ok()) return;
  const std::string name = r->name();
  const int guard = r->guard_pid();
  EXPECT(exists(name), "%s should exist while the region is being set up", name.c_str());
  EXPECT(guard > 0 && running(guard), "the region should have a running guard (pid %d)", guard);
  r->base()[123] = 7;
  r->unlink();
  EXPECT(!exists(name), "unlink() left %s", name.c_str());
  EXPECT(r->base()[123] == 7, "the mapping must outlive the name");
  // Reaped: no zombie left behind (kill(pid, 0) fails once it is reaped).
  EXPECT(!running(guard), "the guard %d was not reaped after unlink()", guard);
  r.reset();
  // The destructor alone does it too.
  s = Region::create(1 << 20, true, r);
  const std::string name2 = r->name();
  const int guard2 = r->guard_pid();
  r.reset();
  EXPECT(!exists(name2) && !running(guard2), "the destructor left %s or its guard %d", name2.c_str(), guard2);
  printf("%s in process: unlink() and the destructor remove the name and reap the guard\n",
         g_failures == f0 ? "PASS" : "FAIL");
}

// A child creates a named region, reports its name, then ends by `how`:
// SIGKILL from us, _exit() of its own, or SIGKILL after its process group
// got SIGINT and SIGTERM (which the guard ignores, in its own session).
enum class End { kKilled, kExit, kSignalsThenKilled };

void test_child_ends(End how, const char* what) {
  const int f0 = g_failures;
  // p: the child's report; go: closed by us once we have seen the name, so
  // that an _exit() child cannot end (and its guard unlink) before we look.
  int p[2], go[2];
  if (pipe(p) != 0) return;
  if (pipe(go) != 0) return;
  const pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);
    // The job itself outlives the signals (as a Python program that handles
    // them might); the point is whether its guard does.
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    close(p[0]);
    close(go[1]);
    std::unique_ptr<Region> r;
    if (!Region::create(4 << 20, true, r).ok()) _exit(2);
    char buf[256];
    snprintf(buf, sizeof buf, "%s %d\n", r->name().c_str(), r->guard_pid());
    if (write(p[1], buf, strlen(buf)) < 0) _exit(3);
    if (how == End::kExit) {
      char c;
      while (read(go[0], &c, 1) > 0) {
      }
      _exit(1);  // no destructors, as os._exit
    }
    for (;;) pause();
  }
  close(p[1]);
  close(go[0]);
  char buf[256] = {};
  size_t got = 0;
  while (got < sizeof buf - 1) {
    const ssize_t r = read(p[0], buf + got, sizeof buf - 1 - got);
    if (r <= 0) break;
    got += (size_t)r;
    if (memchr(buf, '\n', got)) break;
  }
  close(p[0]);
  char name[200] = {};
  int guard = -1;
  EXPECT(sscanf(buf, "%199s %d", name, &guard) == 2, "%s: the child reported '%s'", what, buf);
  EXPECT(exists(name), "%s: %s should exist while its process lives", what, name);
  close(go[1]);
  if (how == End::kSignalsThenKilled) {
    kill(-child, SIGINT);
    kill(-child, SIGTERM);
    kill(-child, SIGHUP);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT(running(guard), "%s: the guard did not survive the job's signals", what);
  }
  if (how != End::kExit) kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT(gone_within(name, 10), "%s: %s is still in /dev/shm 10 s after its process ended", what, name);
  printf("%s %s: the name is gone after the process is\n", g_failures == f0 ? "PASS" : "FAIL", what);
}

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  test_in_process();
  test_child_ends(End::kKilled, "SIGKILL while holding a region");
  test_child_ends(End::kExit, "_exit() without destructors");
  test_child_ends(End::kSignalsThenKilled, "SIGINT, SIGTERM and SIGHUP to the job, then SIGKILL");
  if (g_failures) {
    fprintf(stderr, "test_region: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  printf("test_region: all passed\n");
  return 0;
}
