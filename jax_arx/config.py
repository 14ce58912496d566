"""jax_arx's settings, read from the ``JAX_ARX_*`` environment variables.

This is the only place jax_arx reads its environment. Each variable is
parsed strictly (``_env_values`` holds a reader per kind of value): a bad
value raises :class:`jax_arx.ConfigError` naming the variable, the value
and what is accepted, because a typo silently turning into a default is
the kind of mistake that shows up only as a slow or hung job on the
cluster.

=========================  =======================================  =========
variable                   meaning                                  default
=========================  =======================================  =========
JAX_ARX_TIMEOUT_S          bound of every wait on peers, seconds    30
                           (rendezvous, connection, each collective)
JAX_ARX_JOIN_TIMEOUT_S     how long distributed_initialize waits    30
                           for every process of the job to
                           arrive, seconds (docs/multi-host.md)
JAX_ARX_IDLE_SPIN_MS       the proxy spins this long after work     200
JAX_ARX_IDLE_NAP_US        then naps this long per turn (0: spin)   200
JAX_ARX_TRANSPORT          shm | tcp | verbs                        automatic
JAX_ARX_TOPOLOGY           mesh (every rank reaches every other:    mesh
                           a switch) | ring (2-4 boxes cabled in
                           a ring, no switch: a rank reaches only
                           its two neighbours;
                           docs/topology.md); jax_arx.initialize's
                           ``topology`` argument overrides it
JAX_ARX_FALLBACK           lax (use jax.lax, log once per reason)   lax
                           | error (raise JaxArxFallbackError)
JAX_ARX_GRAD_SUMS          jax_arx: the sums jax.grad adds under    jax_arx
                           shard_map(check_vma=True) (jax's pvary,
                           transposed) run on jax_arx where it has
                           the axis | lax: jax.lax sums them
JAX_ARX_ON_FAILURE         raise | abort (exit the process with     raise
                           the failure message)
JAX_ARX_SLOT_BYTES         per-peer slot; the one-shot size limit   1 MiB
JAX_ARX_SEND_BYTES         per-parity send buffer (two-shot)        4 MiB
JAX_ARX_ONESHOT_MAX_BYTES  one-shot up to here, then two-shot (GPU)  slot
                           up to min(send, world x slot)            bytes;
                                                                    GPU host
                                                                    inboxes:
                                                                    128 KiB
JAX_ARX_PREFILL_SLOT_BYTES per-parity buffer of the bulk ops        32 MiB
                           (all_gather output, psum_scatter input,
                           world x the largest slice; pinned 4 x
                           from the first one traced; 0: none,
                           they fall back to jax.lax)
JAX_ARX_SECRET             a secret every process of the job        unset
                           shares (16+ characters): the tcp
                           carrier's pair keys need it, so even
                           someone who rewrites jax.distributed's
                           key-value store cannot pose as a rank
JAX_ARX_TCP_ADDR           IPv4 address the tcp carrier listens on  the one
                           and advertises                           routing to
                                                                    the
                                                                    coordinator
JAX_ARX_IB_HCA             RDMA devices for verbs (else             unset
                           NCCL_IB_HCA); in a ring the port
                           facing the previous rank, then the
                           one facing the next
JAX_ARX_IB_GID_INDEX       force this RoCE GID index                found
JAX_ARX_IB_TIMEOUT         verbs QP ack timeout, 4.096 us << N,     14
                           1..31 (else NCCL_IB_TIMEOUT)
JAX_ARX_IB_RETRY_CNT       verbs resends before a write fails,      7
                           0..7 (else NCCL_IB_RETRY_CNT)
JAX_ARX_IB_TC              verbs traffic class, 0..255 (else        0
                           NCCL_IB_TC)
JAX_ARX_IB_SL              verbs service level, 0..15 (else         0
                           NCCL_IB_SL)
JAX_ARX_IBVERBS_LIB        the libibverbs to load                   libibverbs
                                                                    .so.1
JAX_ARX_CUDA_DIRECT        0: GPUs of one host send through the     1
                           proxy instead of writing the peers'
                           inboxes themselves
JAX_ARX_CUDA_PEER_MEMORY   GPUs of one host: inboxes in GPU memory  where
                           mapped into the peers' GPUs (1:          every rank
                           required, 0: pinned host memory)         can map
JAX_ARX_DEBUG              1: log set-up steps, stall counters      0
=========================  =======================================  =========

Sizes accept a plain byte count or a binary suffix: ``65536``, ``64K``,
``64KiB``, ``1M``, ``1MiB``, ``1G``.

Settings that benchmarks decided are no user settings: the pieces a psum is
cut into on GPUs, how far the LL one-shot goes, how the verbs carrier splits
its writes, the pieces of a bulk collective on the CPU, whether the fused MoE
combine runs where the plan steps aside for its unfused pair, how many
threads the shm carrier copies with. Tests and
benchmarks that must reach a path the defaults take only at other sizes (or
not at all) pass them to ``jax_arx.initialize(mesh, _tuning={...})``
(``TUNING_KEYS``). The variables that used to set them
(``RETIRED``) are ignored with one warning.

Any other ``JAX_ARX_*`` variable in the environment is refused with a
:class:`jax_arx.ConfigError` naming the closest known one, since a misspelled
name would leave its setting at the default without a word; the variables
other parts of the project read (the build's, the tests') are known too
(``OTHER_READERS``).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping

from jax_arx import _env_values as _values
from jax_arx._env_values import size_setting as size_setting  # the benchmarks' import
from jax_arx.errors import ConfigError

TRANSPORTS = ("shm", "tcp", "verbs")
TOPOLOGIES = ("mesh", "ring")
# The largest ring: past it a rank's data for a far rank would go through
# more than one relay (ffi/base/topology.h, kMaxRingWorld).
MAX_RING_WORLD = 4
# jax_arx.initialize(_tuning=...): the endpoint options a test or a benchmark
# may set (ffi/base/config.h, "tuning").
# moe_fused=1: the fused MoE combine runs wherever it fits (the plan would
# otherwise run its unfused pair: ffi/comm/plan.cc, plan_moe_combine);
# norm_fused=1: psum_add_norm's fused kernels, likewise (plan_add_norm).
# shm_copy_threads: the shm carrier's copy helpers per rank (-1: by the
# host's cores; 0: the proxy thread copies alone: ffi/transport/copy_pool.h).
TUNING_KEYS = (
    "cuda_chunk_bytes",
    "cuda_ll_max_bytes",
    "ib_chunk_bytes",
    "bulk_piece_bytes",
    "moe_fused",
    "norm_fused",
    "shm_copy_threads",
)
# Variables of earlier releases whose settings benchmarks have decided.
RETIRED = ("JAX_ARX_CUDA_PIPELINE", "JAX_ARX_CUDA_CHUNK_BYTES", "JAX_ARX_CUDA_LL_MAX_BYTES", "JAX_ARX_IB_CHUNK_BYTES")
# Every variable load() reads (tests/test_config_unit.py checks this against
# what it asks the environment for): a JAX_ARX_* variable that is in none of
# VARIABLES, RETIRED and OTHER_READERS is a typo, refused by load().
VARIABLES = (
    "JAX_ARX_TIMEOUT_S",
    "JAX_ARX_JOIN_TIMEOUT_S",
    "JAX_ARX_IDLE_SPIN_MS",
    "JAX_ARX_IDLE_NAP_US",
    "JAX_ARX_TRANSPORT",
    "JAX_ARX_TOPOLOGY",
    "JAX_ARX_FALLBACK",
    "JAX_ARX_GRAD_SUMS",
    "JAX_ARX_ON_FAILURE",
    "JAX_ARX_SLOT_BYTES",
    "JAX_ARX_SEND_BYTES",
    "JAX_ARX_ONESHOT_MAX_BYTES",
    "JAX_ARX_PREFILL_SLOT_BYTES",
    "JAX_ARX_TCP_ADDR",
    "JAX_ARX_SECRET",
    "JAX_ARX_IB_HCA",
    "JAX_ARX_IB_GID_INDEX",
    "JAX_ARX_IB_TIMEOUT",
    "JAX_ARX_IB_RETRY_CNT",
    "JAX_ARX_IB_TC",
    "JAX_ARX_IB_SL",
    "JAX_ARX_IBVERBS_LIB",
    "JAX_ARX_CUDA_DIRECT",
    "JAX_ARX_CUDA_PEER_MEMORY",
    "JAX_ARX_DEBUG",
)
# JAX_ARX_* variables that other parts of the project read, and who reads
# each: a build's or a test run's environment may hold them while jax_arx
# runs, so load() takes them for no typo (and reads nothing from them).
OTHER_READERS = {
    # The build: pyproject.toml hands the variable to CMake.
    "JAX_ARX_CUDA": "the build (pyproject.toml, CMakeLists.txt)",
    # The build: CMakeLists.txt reads $ENV{JAX_ARX_VERBS}.
    "JAX_ARX_VERBS": "the build (CMakeLists.txt)",
    # CMake options (-D..., pip's -C cmake.define....), which build scripts
    # may keep in the environment beside the two above.
    "JAX_ARX_PYTHON": "the build (CMakeLists.txt option)",
    "JAX_ARX_TESTS": "the build (CMakeLists.txt option)",
    "JAX_ARX_TESTING": "the build (CMakeLists.txt option)",
    "JAX_ARX_TSAN": "the build (CMakeLists.txt option)",
    "JAX_ARX_TRACE": "the build (CMakeLists.txt option)",
    # The soak suite's number of calls.
    "JAX_ARX_SOAK_CALLS": "tests/test_soak_cpu.py",
}
FALLBACKS = ("lax", "error")
GRAD_SUMS = ("jax_arx", "lax")
ON_FAILURE = ("raise", "abort")


@dataclasses.dataclass(frozen=True)
class Config:
    """One parsed snapshot of the ``JAX_ARX_*`` environment."""

    timeout_s: float = 30.0
    # jax_arx.distributed_initialize's wait for the job's processes (_join.py).
    join_timeout_s: float = 30.0
    idle_spin_ms: int = 200
    idle_nap_us: int = 200
    transport: str | None = None  # None: chosen per communicator (see _carriers.choose_transport)
    topology: str = "mesh"  # or "ring": links to the previous and next rank only (ffi/base/topology.h)
    fallback: str = "lax"
    grad_sums: str = "jax_arx"  # jax_arx/_grad.py
    on_failure: str = "raise"
    slot_bytes: int = 1 << 20
    oneshot_max_bytes: int | None = None  # None: slot_bytes, 128 KiB on GPU host inboxes (ffi/comm/plan.cc)
    send_bytes: int = 4 << 20
    # all_gather / psum_scatter / the fused MoE combine: the largest gathered
    # output (or scattered input) per call. Their endpoints, made at the
    # first one traced (_bulk_endpoints.py), pin 4x this.
    bulk_bytes: int = 32 << 20
    tcp_addr: str | None = None  # None: the address that routes to the coordinator
    # JAX_ARX_SECRET; never printed (repr=False). See _endpoints.group_secret.
    secret: str | None = dataclasses.field(default=None, repr=False)
    ib_hca: str | None = None
    ib_gid_index: int | None = None  # None: the verbs carrier finds it
    # The verbs queue-pair settings; None: the carrier's defaults (ffi/comm/config.h:
    # timeout 14 = 67 ms, retry count 7, traffic class 0, service level 0, writes whole).
    ib_timeout: int | None = None
    ib_retry_cnt: int | None = None
    ib_tc: int | None = None
    ib_sl: int | None = None
    ibverbs_lib: str | None = None  # None: libibverbs.so.1, then libibverbs.so
    cuda_direct: bool = True  # shm on GPUs: kernels write the peers' inboxes themselves
    cuda_peer_memory: bool | None = None  # direct mode: inboxes in GPU memory; None: where every rank can map them
    debug: bool = False

    def endpoint_options(self, tcp_addr: str | None, tuning: Mapping[str, int] | None = None) -> dict[str, str]:
        """The options dict ``_core.Endpoint`` takes: every value a string,
        only keys it knows (it rejects unknown keys, so a typo here fails
        loudly instead of being ignored). ``tuning``: see TUNING_KEYS."""
        options = {
            "slot_bytes": str(self.slot_bytes),
            "send_bytes": str(self.send_bytes),
            "bulk_bytes": str(self.bulk_bytes),
            "timeout_s": repr(float(self.timeout_s)),
            "idle_spin_ms": str(self.idle_spin_ms),
            "idle_nap_us": str(self.idle_nap_us),
            "abort_on_failure": "1" if self.on_failure == "abort" else "0",
            "verbose": "1" if self.debug else "0",
        }
        if tcp_addr:
            options["tcp_addr"] = tcp_addr
        if self.topology != "mesh":
            options["topology"] = self.topology
        if self.ib_hca:
            options["ib_hca"] = self.ib_hca
        # The rest only when set, so the options of a set-up without RDMA stay
        # the few every carrier reads.
        if self.oneshot_max_bytes is not None:
            options["oneshot_max_bytes"] = str(self.oneshot_max_bytes)
        for key in ("ib_gid_index", "ib_timeout", "ib_retry_cnt", "ib_tc", "ib_sl"):
            value = getattr(self, key)
            if value is not None:
                options[key] = str(value)
        if self.ibverbs_lib:
            options["ibverbs_lib"] = self.ibverbs_lib
        if not self.cuda_direct:
            options["cuda_direct"] = "0"
        if self.cuda_peer_memory is not None:
            options["cuda_peer_memory"] = "1" if self.cuda_peer_memory else "0"
        for key, value in (tuning or {}).items():
            if key not in TUNING_KEYS:
                raise ValueError(f"jax_arx: _tuning key {key!r} is not one of {TUNING_KEYS}")
            options[key] = str(int(value))
        return options


def load(environ: Mapping[str, str] | None = None) -> Config:
    """Parses the ``JAX_ARX_*`` variables of ``environ`` (default
    ``os.environ``) into a :class:`Config`.

    Raises:
      ConfigError: a variable is set to a value that is not accepted (the
        message names it and lists what is), or a ``JAX_ARX_*`` variable is
        set that jax_arx does not know (the message names it and the
        closest known one).
    """
    env = os.environ if environ is None else environ
    _refuse_unknown(env)
    _warn_retired(env)
    defaults = Config()
    slot_bytes = _values.size(env, "JAX_ARX_SLOT_BYTES", defaults.slot_bytes)
    send_bytes = _values.size(env, "JAX_ARX_SEND_BYTES", defaults.send_bytes)
    if send_bytes < slot_bytes:
        raise ConfigError(
            f"JAX_ARX_SEND_BYTES ({send_bytes}) must be at least JAX_ARX_SLOT_BYTES ({slot_bytes}): a "
            "one-shot partial is staged in a send buffer; raise JAX_ARX_SEND_BYTES or lower "
            "JAX_ARX_SLOT_BYTES"
        )
    return Config(
        timeout_s=_values.positive_float(env, "JAX_ARX_TIMEOUT_S", defaults.timeout_s),
        join_timeout_s=_values.positive_float(env, "JAX_ARX_JOIN_TIMEOUT_S", defaults.join_timeout_s),
        idle_spin_ms=_values.nonnegative_int(env, "JAX_ARX_IDLE_SPIN_MS", defaults.idle_spin_ms),
        idle_nap_us=_values.nonnegative_int(env, "JAX_ARX_IDLE_NAP_US", defaults.idle_nap_us),
        transport=_values.choice(env, "JAX_ARX_TRANSPORT", TRANSPORTS, None),
        topology=_values.choice(env, "JAX_ARX_TOPOLOGY", TOPOLOGIES, defaults.topology),
        fallback=_values.choice(env, "JAX_ARX_FALLBACK", FALLBACKS, defaults.fallback),
        grad_sums=_values.choice(env, "JAX_ARX_GRAD_SUMS", GRAD_SUMS, defaults.grad_sums),
        on_failure=_values.choice(env, "JAX_ARX_ON_FAILURE", ON_FAILURE, defaults.on_failure),
        slot_bytes=slot_bytes,
        oneshot_max_bytes=_values.size(env, "JAX_ARX_ONESHOT_MAX_BYTES", None),
        send_bytes=send_bytes,
        bulk_bytes=_values.size_or_off(env, "JAX_ARX_PREFILL_SLOT_BYTES", defaults.bulk_bytes),
        tcp_addr=_values.ipv4(env, "JAX_ARX_TCP_ADDR"),
        secret=_values.secret(env, "JAX_ARX_SECRET"),
        ib_hca=_values.string(env, "JAX_ARX_IB_HCA") or _values.string(env, "NCCL_IB_HCA"),
        ib_gid_index=_values.nonnegative_int(env, "JAX_ARX_IB_GID_INDEX", None),
        ib_timeout=_values.int_in(env, "JAX_ARX_IB_TIMEOUT", 1, 31, "NCCL_IB_TIMEOUT"),
        ib_retry_cnt=_values.int_in(env, "JAX_ARX_IB_RETRY_CNT", 0, 7, "NCCL_IB_RETRY_CNT"),
        ib_tc=_values.int_in(env, "JAX_ARX_IB_TC", 0, 255, "NCCL_IB_TC"),
        ib_sl=_values.int_in(env, "JAX_ARX_IB_SL", 0, 15, "NCCL_IB_SL"),
        ibverbs_lib=_values.string(env, "JAX_ARX_IBVERBS_LIB"),
        cuda_direct=_values.flag(env, "JAX_ARX_CUDA_DIRECT", defaults.cuda_direct),
        cuda_peer_memory=_values.flag(env, "JAX_ARX_CUDA_PEER_MEMORY", None),
        debug=_values.flag(env, "JAX_ARX_DEBUG", defaults.debug),
    )


_warned: set = set()


def with_topology(cfg: Config, topology: str | None) -> Config:
    """``cfg`` with ``topology`` (jax_arx.initialize's argument) in place of
    JAX_ARX_TOPOLOGY's; None keeps it.

    Raises:
      ConfigError: ``topology`` is not "mesh" or "ring".
    """
    if topology is None:
        return cfg
    if not isinstance(topology, str) or topology.lower() not in TOPOLOGIES:
        raise ConfigError(
            f"jax_arx.initialize(topology={topology!r}) is not accepted: use one of "
            f"{', '.join(repr(t) for t in TOPOLOGIES)}, or None for JAX_ARX_TOPOLOGY"
        )
    return dataclasses.replace(cfg, topology=topology.lower())


def _refuse_unknown(env) -> None:
    # A misspelled name (JAX_ARX_TIMEOUT for JAX_ARX_TIMEOUT_S) would
    # otherwise leave the setting at its default without a word. Set to
    # empty counts too: the name is still wrong. Case is ignored in the
    # prefix, since jax_arx_timeout_s is the same typo.
    known = (*VARIABLES, *RETIRED, *OTHER_READERS)
    unknown = sorted(name for name in env if name.upper().startswith("JAX_ARX_") and name not in known)
    if not unknown:
        return
    lines = []
    for name in unknown:
        close = _closest(name)
        retired = "; that one is retired, nothing reads it" if close in RETIRED else ""
        lines.append(f"{name} (did you mean {close}?{retired})" if close else name)
    one = len(lines) == 1
    raise ConfigError(
        f"{', '.join(lines)} {'is' if one else 'are'} set, but jax_arx has no such "
        f"{'variable' if one else 'variables'}: rename {'it' if one else 'each'} to the variable meant, or unset "
        f"{'it' if one else 'each'} if not meant for jax_arx (docs/configuration.md lists the variables it reads)"
    )


def _closest(name: str) -> str | None:
    # Compared without the common prefix, which would otherwise make every
    # known name look close (JAX_ARX_FOO to JAX_ARX_TOPOLOGY).
    prefix = len("JAX_ARX_")
    names = {known[prefix:]: known for known in (*VARIABLES, *OTHER_READERS, *RETIRED)}
    close = difflib.get_close_matches(name.upper()[prefix:], list(names), n=1, cutoff=0.6)
    return names[close[0]] if close else None


def _warn_retired(env) -> None:
    for name in RETIRED:
        if _values.raw(env, name) is not None and name not in _warned:
            _warned.add(name)
            logging.getLogger("jax_arx").warning(
                "%s is no longer a setting (a benchmark decided it); it is ignored: unset it", name
            )
