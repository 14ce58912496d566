"""Run N local processes of a JAX program with jax.distributed wired up.

Usage:

.. code-block:: text

    python -m jax_arx.launch -n N [--cpu-devices K] [--gpus-per-process G]
                             [--grace-s S] script.py [args...]
    python -m jax_arx.launch -n N [...] -m package.module [args...]

Each rank gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>``,
``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=<rank>`` and
``PYTHONUNBUFFERED=1``; the program calls
``jax_arx.distributed_initialize()`` first (``jax_arx.initialize()`` raises
``InitializationError`` in a rank that did not, rather than let each rank
run as a one-process job). Unless ``JAX_ARX_SECRET`` is in
the environment already (set it empty to go without), the ranks also share a
fresh random one, so that nobody who reaches jax.distributed's coordinator
can pose as a rank (docs/failures.md). Every line a rank prints comes
out prefixed with ``[rank k] `` (stdout to stdout, stderr to stderr).

``--cpu-devices K`` runs every rank on the CPU backend with K devices
(``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=K``). ``--gpus-per-process G``
gives rank k the GPUs k*G .. k*G+G-1 (``JAX_LOCAL_DEVICE_IDS``).

The launcher exits 0 when every rank does. When a rank fails, it names the
first rank that failed and repeats the end of that rank's stderr (its
traceback), gives the others ``--grace-s`` seconds (default 2) to finish or
report their own errors, then terminates them (SIGTERM, then SIGKILL 2 s
later), so a rank blocked in a collective with a dead peer never hangs the
job; it then exits with the first failing rank's status. A rank that raises
an exception nothing catches ends at once (``jax_arx.distributed_initialize``
makes it skip the exit-time barriers), so the whole job ends within a few
seconds of the exception.

Ranks never outlive the launcher: SIGINT, SIGTERM and SIGHUP (a closed
terminal, a dropped ssh) to it stop them the same way, and where the
launcher itself is killed outright (SIGKILL), Linux kills every rank with
it (a parent-death signal, ``prctl(PR_SET_PDEATHSIG)``), so no rank is left
holding GPU memory and ports.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from jax_arx._distributed import _ENV_ADDRESS, _ENV_ID, _ENV_NUM, initialize_distributed  # noqa: F401

# --- the launcher -----------------------------------------------------------

_VALUED = {"-n", "--nprocs", "--cpu-devices", "--gpus-per-process", "--grace-s"}


def _split_argv(argv):
    """Splits argv into the launcher's options and the program's command:
    the program starts at ``-m MODULE``, after ``--``, or at the first word
    that is not a launcher option, so its own options pass through."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], argv[i + 1 :]
        if a == "-m":
            return argv[:i], argv[i:]
        if a in _VALUED:
            i += 2
            continue
        if a.startswith("-") and (a.split("=", 1)[0] in _VALUED or a in ("-h", "--help")):
            i += 1
            continue
        if a.startswith("-n") and a[2:].isdigit():
            i += 1
            continue
        return argv[:i], argv[i:]
    return argv, []


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m jax_arx.launch",
        description="Run N local processes of a JAX program with jax.distributed wired up.",
        epilog="The program follows the options: script.py [args...] or -m module [args...].",
    )
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of processes")
    p.add_argument("--cpu-devices", type=int, metavar="K", help="run on the CPU backend with K devices per process")
    p.add_argument(
        "--gpus-per-process", type=int, metavar="G", help="give rank k the GPUs k*G .. k*G+G-1 (JAX_LOCAL_DEVICE_IDS)"
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=2.0,
        metavar="S",
        help="after a rank fails, how long the others get before they are terminated (default 2)",
    )
    return p


def _free_port() -> int:
    # The port is free now; the coordinator binds it a moment later. The race
    # with another program taking it in between is accepted.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TAIL_LINES = 15  # how much of the first failing rank's stderr the launcher repeats


class _Pump(threading.Thread):
    """Copies one child's stream to ours line by line, each line prefixed,
    and keeps the last lines (``tail``)."""

    def __init__(self, stream, out, prefix: bytes, lock):
        super().__init__(daemon=True)
        self._stream, self._out, self._prefix, self._lock = stream, out, prefix, lock
        self.tail = collections.deque(maxlen=_TAIL_LINES)

    def run(self):
        for line in iter(self._stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            self.tail.append(line)
            with self._lock:
                self._out.write(self._prefix + line)
                self._out.flush()
        self._stream.close()


def _exit_status(returncode: int) -> int:
    # A rank killed by signal s reports -s; shells report that as 128 + s.
    return returncode if returncode > 0 else 128 - returncode


def main(argv=None) -> int:
    """Runs the launcher; returns its exit status (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, program = _split_argv(argv)
    parser = _parser()
    args = parser.parse_args(ours)
    if not program or program == ["-m"]:
        parser.error("give the program to run: script.py [args...] or -m module [args...]")
    if args.nprocs < 1:
        parser.error(f"-n must be at least 1, got {args.nprocs}")
    for name in ("cpu_devices", "gpus_per_process"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    command = [sys.executable, "-u", *program]

    address = f"127.0.0.1:{_free_port()}"
    secret = None if "JAX_ARX_SECRET" in os.environ else secrets.token_hex(32)
    die_with_launcher = _parent_death_hook()
    # Before the first rank starts: a signal that comes while the ranks
    # start (a rank may be running before the next is spawned) still stops
    # every rank and is reported, instead of ending the launcher alone.
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    procs = []
    pumps = []
    stderr_pumps = []  # by rank
    lock = threading.Lock()
    for rank in range(args.nprocs):
        env = dict(os.environ)
        env.update({_ENV_ADDRESS: address, _ENV_NUM: str(args.nprocs), _ENV_ID: str(rank), "PYTHONUNBUFFERED": "1"})
        if secret is not None:
            env["JAX_ARX_SECRET"] = secret
        if args.cpu_devices is not None:
            env["JAX_PLATFORMS"] = "cpu"
            env["JAX_NUM_CPU_DEVICES"] = str(args.cpu_devices)
        if args.gpus_per_process is not None:
            g = args.gpus_per_process
            env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(rank * g + i) for i in range(g))
        # Each rank leads its own process group, so terminating a rank also
        # reaches whatever it started.
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_launcher,
        )
        procs.append(proc)
        prefix = f"[rank {rank}] ".encode()
        stderr_pumps.append(_Pump(proc.stderr, sys.stderr.buffer, prefix, lock))
        pumps += [_Pump(proc.stdout, sys.stdout.buffer, prefix, lock), stderr_pumps[-1]]
    for pump in pumps:
        pump.start()

    def note(message):
        with lock:
            sys.stderr.buffer.write(f"[launch] {message}\n".encode())
            sys.stderr.buffer.flush()

    status = 0
    stop_at = None  # when to terminate the ranks still running
    killed_at = None
    try:
        while True:
            running = [p for p in procs if p.poll() is None]
            for rank, p in enumerate(procs):
                if p.returncode not in (None, 0) and status == 0:
                    status = _exit_status(p.returncode)
                    if running:
                        stop_at = time.monotonic() + args.grace_s
                    stderr_pumps[rank].join(timeout=1)  # the rank's last lines, read to the end
                    then = f"; stopping the other ranks in {args.grace_s:g} s" if running else ""
                    note(_first_failure(rank, p.returncode, then, stderr_pumps[rank].tail))
            if not running:
                break
            if interrupted and stop_at is None:
                note(f"got signal {interrupted[0]}; stopping the ranks")
                status = status or 128 + interrupted[0]
                stop_at = time.monotonic()
            now = time.monotonic()
            if stop_at is not None and now >= stop_at and killed_at is None:
                for p in running:
                    _signal_group(p, signal.SIGTERM)
                killed_at = now
            elif killed_at is not None and now >= killed_at + 2:
                for p in running:
                    _signal_group(p, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
    for pump in pumps:
        pump.join(timeout=5)
    return status


def _first_failure(rank: int, returncode: int, then: str, tail) -> str:
    """The launcher's report of the first rank that failed: its status, what
    happens next (``then``), and the end of its stderr (a Python rank's
    traceback ends there)."""
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
    report = f"rank {rank} failed first ({how}){then}"
    lines = [line.decode(errors="replace").rstrip("\n") for line in tail]
    if lines:
        report += ". The end of its stderr:\n" + "\n".join(f"[launch]   {line}" for line in lines)
    return report


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _parent_death_hook():
    """What each rank's process runs before the program (Popen's
    preexec_fn): SIGKILL the rank when the launcher's thread that started it
    (the main one) goes, however the launcher ends. prctl is looked up here,
    before any fork, so that the hook itself makes one system call (the
    launcher has no other thread yet when it starts ranks). None where there
    is no prctl (not Linux): the signal handlers are all there is then."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _signal_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    sys.exit(main())
