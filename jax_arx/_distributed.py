"""jax.distributed from the environment the launcher sets (jax_arx.launch).

Kept apart from the launcher so that ``import jax_arx`` does not import
``jax_arx.launch``, which ``python -m jax_arx.launch`` runs as ``__main__``.
"""

from __future__ import annotations

import atexit
import os
import sys

_ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
_ENV_NUM = "JAX_NUM_PROCESSES"
_ENV_ID = "JAX_PROCESS_ID"


def initialize_distributed() -> bool:
    """Calls ``jax.distributed.initialize`` from the environment the
    launcher sets; call it first thing, before anything starts a jax
    backend.

    Reads ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``. Where none is set but the process is one task of
    several under SLURM (``SLURM_NTASKS``) or Open MPI
    (``OMPI_COMM_WORLD_SIZE``), it calls ``jax.distributed.initialize()``
    with no arguments: jax's own cluster detection reads the rest from that
    environment. On CPU it also selects the gloo cross-process collectives
    (when this jax has that option and nothing else was chosen), so
    ``jax.lax`` collectives work across processes there too.

    In a process set up here, an exception that nothing catches ends the
    process at once (status 1, after Python printed the traceback): it does
    not wait at jax_arx's and jax's exit-time barriers for peers that may
    never get there (see ``python -m jax_arx.launch``). So does SIGTERM
    (status 143), unless the program installed its own handler for it
    before: jax's preemption notifier would only log it.

    Returns:
      True when jax.distributed is initialized (now or already), False when
      none of the variables is set and no cluster manager started several
      tasks (a single process: nothing to do; ``jax_arx.initialize`` then
      warns if the mesh has nothing to reduce over).

    Before jax.distributed starts, the processes meet on the coordinator's
    port (``JAX_ARX_JOIN_TIMEOUT_S``, 30 s by default): a coordinator
    address that does not resolve or cannot be reached, a port another
    program holds, a rank that did not start, or two processes with one
    rank fail every process that started within that time, each naming the
    address or the ranks, where jax alone would wait five minutes and then
    abort without naming either.

    Raises:
      ValueError: only some of the variables are set, or one is malformed.
      InitializationError: the processes did not all meet (see above).
      ConfigError: a ``JAX_ARX_*`` variable is malformed or unknown.
    """
    values = {name: os.environ.get(name) for name in (_ENV_ADDRESS, _ENV_NUM, _ENV_ID)}
    present = {name: v for name, v in values.items() if v}
    if not present:
        return _from_cluster_manager()
    missing = [name for name in values if name not in present]
    if missing:
        raise ValueError(
            f"jax_arx.distributed_initialize: {', '.join(missing)} not set while "
            f"{', '.join(present)} is; set all three (python -m jax_arx.launch does) or none."
        )
    try:
        num_processes = int(values[_ENV_NUM])
        process_id = int(values[_ENV_ID])
    except ValueError:
        raise ValueError(
            f"jax_arx.distributed_initialize: {_ENV_NUM}={values[_ENV_NUM]!r} and {_ENV_ID}={values[_ENV_ID]!r} "
            "must be integers"
        ) from None
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"jax_arx.distributed_initialize: {_ENV_ID}={process_id} must be in [0, {_ENV_NUM}={num_processes})"
        )

    import jax

    if jax.distributed.is_initialized():
        return True
    from jax_arx import _join, config

    settings = config.load()
    if num_processes > 1:
        # jax's own start-up names no address and no rank when one is wrong
        # or missing, and waits minutes: the processes meet first (_join.py).
        _join.join(values[_ENV_ADDRESS], num_processes, process_id, settings.join_timeout_s, settings.secret)
    _select_cpu_collectives(jax)
    # Every process has arrived: jax's connection is quick, and a process
    # lost between the two fails the others within this bound, not jax's 5 minutes.
    jax.distributed.initialize(
        coordinator_address=values[_ENV_ADDRESS],
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(max(30.0, settings.join_timeout_s)),
    )
    _end_at_once_on_exit_or_sigterm()
    return True


def _end_at_once_on_exit_or_sigterm() -> None:
    # The exit hook is registered after jax's own, so it runs before it (exit
    # hooks run last-registered first). jax_arx's shutdown(), registered
    # when jax_arx.initialize() loads it, may run before this one: on an
    # uncaught exception it skips its barrier, so either order ends at once.
    atexit.register(_end_at_once_on_uncaught_exception)
    import signal
    import threading

    # Python reports a handler installed in C (jax's preemption notifier) as
    # None: replaced; one the program installed from Python is kept.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL,
        None,
    ):
        signal.signal(signal.SIGTERM, _end_on_sigterm)


def _end_on_sigterm(signum, frame) -> None:
    # A rank asked to end (by the launcher, a scheduler, kill) ends now,
    # with the status a shell gives a death by that signal. No exit hook
    # runs: jax_arx's shutdown() could wait for a lock the interrupted code
    # holds, and jax's at an exit barrier for peers. The kernel closes this
    # rank's links, so its peers fail their next collective naming it, and
    # the shared-memory regions' guard unlinks them once every process that
    # mapped them is gone.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        os.write(2, f"jax_arx: this process got signal {signum} (SIGTERM) and ends now\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)


# Variables that say a cluster manager started this process as one task of
# several; jax.distributed.initialize() detects these managers itself.
_CLUSTER_TASKS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _from_cluster_manager() -> bool:
    tasks = {}
    for name in _CLUSTER_TASKS:
        try:
            tasks[name] = int(os.environ.get(name, "1"))
        except ValueError:
            continue
    if max(tasks.values(), default=1) <= 1:
        return False
    import jax

    if not jax.distributed.is_initialized():
        _select_cpu_collectives(jax)
        jax.distributed.initialize()
        _end_at_once_on_exit_or_sigterm()
    return True


def _select_cpu_collectives(jax) -> None:
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:
        pass  # a jax without the option: its CPU backend picks its own


def refuse_if_not_joined() -> None:
    """Raises when the environment says this process is one of several
    (``JAX_NUM_PROCESSES`` > 1, as ``python -m jax_arx.launch`` sets it) but
    jax.distributed is not initialized in it: the program forgot
    ``jax_arx.distributed_initialize()``, and each process would run as a
    job of its own, every sum one process's value, with status 0.

    Raises:
      InitializationError: naming the variable and the call to add.
    """
    try:
        num_processes = int(os.environ.get(_ENV_NUM, ""))
    except ValueError:
        return  # unset; a malformed value is distributed_initialize's to report
    if num_processes <= 1:
        return
    import jax

    if jax.distributed.is_initialized():
        return
    from jax_arx.errors import InitializationError

    raise InitializationError(
        f"jax_arx.initialize: {_ENV_NUM}={num_processes} says this process is one of {num_processes} (python -m "
        "jax_arx.launch sets it), but jax.distributed is not initialized in it, so it would run alone and every "
        "collective would return this process's value only. Call jax_arx.distributed_initialize() first thing in "
        "the program, before any other jax call."
    )


_warned_alone = []


def warn_if_alone(mesh) -> None:
    """Once per process: a warning when this process runs alone and every
    axis of ``mesh`` has one device, so jax_arx's collectives have nothing
    to reduce over (a script started without the launcher, or without
    ``distributed_initialize``, gives a one-process job that looks fine)."""
    import jax

    if _warned_alone or jax.distributed.is_initialized() or any(size > 1 for size in mesh.shape.values()):
        return
    _warned_alone.append(True)
    import logging

    logging.getLogger("jax_arx").warning(
        "jax_arx.initialize: this process runs alone (jax.distributed is not initialized) and every axis of the "
        "mesh has one device, so jax_arx's collectives have nothing to reduce over. For N processes: call "
        "jax_arx.distributed_initialize() first thing in the program and start it with `python -m "
        "jax_arx.launch -n N program.py` (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, "
        "or run it as a SLURM or Open MPI job of several tasks)"
    )


_warned_cpu = []

# Where the NVIDIA driver shows a GPU (the build's JAX_ARX_CUDA=AUTO looks
# at the same places, CMakeLists.txt).
_NVIDIA_MARKS = ("/dev/nvidia0", "/proc/driver/nvidia/gpus")


def nvidia_gpu_present(marks=_NVIDIA_MARKS) -> bool:
    """Whether the NVIDIA driver shows a GPU on this machine: the device
    file, or a non-empty ``/proc/driver/nvidia/gpus``."""
    for mark in marks:
        if os.path.isdir(mark):
            if os.listdir(mark):
                return True
        elif os.path.exists(mark):
            return True
    return False


def warn_if_cpu_beside_a_gpu(mesh, marks=_NVIDIA_MARKS) -> bool:
    """Once per process: a warning when ``mesh`` is of CPU devices on a
    machine whose NVIDIA driver shows a GPU (jax for CUDA missing, or one
    that does not match the driver: jax_arx then runs, and is timed, on
    the CPU). Returns whether it warned."""
    if _warned_cpu or any(d.platform != "cpu" for d in mesh.devices.flat) or not nvidia_gpu_present(marks):
        return False
    import jax

    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False  # the CPU was asked for
    _warned_cpu.append(True)
    import logging

    logging.getLogger("jax_arx").warning(
        "jax_arx.initialize: this machine has an NVIDIA GPU, but jax %s runs on the CPU, so jax_arx does too. "
        'Install jax for CUDA in this environment (`pip install "jax[cuda13]"`, or the CUDA 12 build for an '
        "older driver; `nvidia-smi` shows the driver's CUDA version), then check that jax.devices() lists a "
        "CudaDevice; set JAX_PLATFORMS=cpu to run on the CPU on purpose",
        jax.__version__,
    )
    return True


# What closes jax_arx's endpoints when a rank ends on an uncaught exception
# (``_comm`` adds its shutdown()): this module stays below the ones it serves.
_closers: list = []


def on_uncaught_exception(close) -> None:
    """Registers ``close()`` (no arguments) to run when the process ends on
    an exception nothing caught, before it exits at once."""
    _closers.append(close)


def uncaught_exception() -> bool:
    """Whether the interpreter is ending because of an exception nothing
    caught: Python stores it in ``sys.last_value`` before it runs the exit
    hooks (a ``sys.exit()`` does not)."""
    return getattr(sys, "last_value", None) is not None


def _end_at_once_on_uncaught_exception() -> None:
    # A rank that raised is of no more use to its peers, which may be busy
    # for minutes before they reach an exit barrier: jax_arx's shutdown()
    # would wait up to JAX_ARX_TIMEOUT_S for them, then jax's own shutdown
    # up to 5 minutes. So the rank closes its endpoints and ends now, with
    # the status Python gives an uncaught exception (exit hooks registered
    # before this one do not run); the launcher sees it
    # fail at once and stops the others, and a peer waiting on this rank in
    # a collective fails within JAX_ARX_TIMEOUT_S, naming it.
    if not uncaught_exception():
        return
    for hook in _closers:
        hook()  # jax_arx's shutdown(), without its barrier: see uncaught_exception()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(130 if isinstance(sys.last_value, KeyboardInterrupt) else 1)  # as Python's own exit would
