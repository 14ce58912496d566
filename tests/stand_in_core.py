"""The in-process unit tests' stand-in for ``jax_arx._core`` and what they share.

The stand-in (``FAKE_CORE_SOURCE``, the ``fake_core`` fixture) plays the
C++ module's endpoints without peers: it checks what jax_arx hands it
(ids, ranks, secrets, the rendezvous details) and registers the endpoints
as connected, so that initialize / shutdown / check and every trace-time
decision run in one process on 4 CPU devices. What it must not make up it
takes from the real module (installed with ``pip install .``): each of its
endpoints has a never-connected twin of the real core, which parses the
options (an unknown key or a bad value raises, as in every endpoint) and
decides what runs each size (``Endpoint.plan``, ffi/comm/plan.cc).

``lax_lowering`` / ``bulk_lax_lowering`` lower jax_arx's primitives with
jax's own collectives instead of the FFI calls: tests that use them check
jax_arx's rules (typing, autodiff, batching, caching), never its sums,
which the multi-process tests check against numpy.

Loaded as a pytest plugin (tests/conftest.py), so that this process's jax
is set to 4 CPU devices before any test starts its backend.
"""

import functools
import importlib.util

import jax
import pytest

import jax_arx
import needs
from jax_arx import _bulk, _bulk_endpoints, _compat, _native, _notice, _policy, _psum

# This process's jax on 4 CPU devices, set in jax's configuration before its
# backend starts (at the first device query): never in the environment,
# which every other test's subprocesses would inherit.
try:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
except RuntimeError:
    pass  # a backend already started: the tests that need 4 devices say so


@pytest.fixture
def four_devices():
    if jax.device_count() < 4:
        needs.missing(
            f"needs 4 CPU devices; jax started with {jax.device_count()} before this module could ask "
            "for 4 (run it in a pytest process of its own)"
        )


needs_4_devices = pytest.mark.usefixtures("four_devices")


def auto_mesh(shape, names, devices=None):
    kwargs = {} if devices is None else {"devices": devices}
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), **kwargs)


def inner_jaxpr(closed_jaxpr):
    """The body of the (only) shard_map in a jaxpr, jit wrappers skipped."""
    jaxpr = closed_jaxpr.jaxpr
    while True:
        eqn = jaxpr.eqns[0]
        inner = eqn.params["jaxpr"]
        jaxpr = getattr(inner, "jaxpr", inner)
        if eqn.primitive.name == "shard_map":
            return jaxpr


def prim_names(jaxpr):
    return [e.primitive.name for e in jaxpr.eqns]


@pytest.fixture
def fake_core(tmp_path, monkeypatch):
    """jax_arx with the stand-in core, as in a fresh process (no bulk
    endpoints remembered for initialize() to make again); shut down
    afterwards."""
    path = tmp_path / "fake_core.py"
    path.write_text(FAKE_CORE_SOURCE)
    spec = importlib.util.spec_from_file_location("fake_core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(_native, "_core_module", module)
    monkeypatch.setattr(_bulk_endpoints, "_made", set())
    yield module
    jax_arx.shutdown()
    assert not module.registered, "shutdown() left endpoints registered"


@pytest.fixture
def lax_lowering():
    """Lowers jax_arx's primitives with jax's all-reduce instead of the FFI
    call, counting lowerings."""
    count = {"n": 0}

    def counting(ctx, *xs, **params):
        count["n"] += 1
        # jax's own all-reduce in place of the FFI call: these tests check
        # jax_arx's rules (typing, autodiff, batching, caching), not its sums.
        leaves = xs[: len(xs) - params.get("prefetch", 0)]
        return _compat.lax_psum_lowering(ctx, leaves, axes=params["axes"])

    for prim in (_psum.psum_p, _psum.psum_invariant_p):
        _compat.register_lowering(prim, counting)
    # A fallback's notice: its operand, with no call the stand-in cannot run.
    _compat.register_lowering(_notice.notice_p, lambda ctx, x, **params: [x], cacheable=False)
    yield count
    for prim in (_psum.psum_p, _psum.psum_invariant_p):
        _compat.register_lowering(prim, _psum._psum_lowering)
    _compat.register_lowering(_notice.notice_p, _notice._notice_lowering, cacheable=False)


@pytest.fixture
def bulk_lax_lowering():
    """all_gather and psum_scatter lowered as jax's own (what
    ``_collective_lowering`` does where it falls back), counting lowerings."""
    count = {"n": 0}
    prims = {
        _bulk.all_gather_p: (
            _bulk.ALL_GATHER_TARGET,
            _compat.lax_all_gather_p,
            "all_gather_dimension",
            _bulk.ALL_GATHER,
        ),
        _bulk.psum_scatter_p: (
            _bulk.PSUM_SCATTER_TARGET,
            _compat.lax_reduce_scatter_p,
            "scatter_dimension",
            _bulk.PSUM_SCATTER,
        ),
    }

    def lowering(lax_prim):
        def lower(ctx, x, **params):
            count["n"] += 1
            return _compat.lax_collective_lowering(lax_prim, ctx, x, **_bulk._lax_params(params))

        return lower

    for prim, (_, lax_prim, _, _) in prims.items():
        _compat.register_lowering(prim, lowering(lax_prim), cacheable=False)
    yield count
    for prim, args in prims.items():
        _compat.register_lowering(prim, functools.partial(_bulk._collective_lowering, *args), cacheable=False)


@pytest.fixture(autouse=True)
def fresh_fallback_log():
    """Each test sees jax_arx's first log line for each fallback reason."""
    _policy._logged_reasons.clear()
    yield


@pytest.fixture
def mesh4(fake_core):
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    return mesh


@pytest.fixture
def mesh22(fake_core):
    mesh = auto_mesh((2, 2), ("dp", "tp"))
    jax_arx.initialize(mesh)
    return mesh


FAKE_CORE_SOURCE = '''
"""A stand-in for jax_arx._core that checks what jax_arx asks of it (see tests/stand_in_core.py)."""
import pickle
import threading

endpoints = []          # every Endpoint made, in order
registered = {}         # (comm_id, device_ordinal) -> Endpoint, while connected
failed = {}             # (comm_id, device_ordinal) -> failure message
partners = {}           # (comm_id, device_ordinal) -> the keys fail_together linked to it
fail_create_rank = None  # make Endpoint(rank=this) raise
_cv = threading.Condition()
_connecting = {}

def version(): return "fake"
def has_cuda(): return False
def registrations(): return {}
def failures(): return [m for k, m in failed.items() if k in registered]

class Endpoint:
    def __init__(self, comm_id, device_ordinal, rank, world, transport, platform, name, secret, options):
        assert isinstance(comm_id, int) and 0 <= comm_id < 2**63, comm_id
        assert all(isinstance(v, int) for v in (device_ordinal, rank, world))
        assert 0 <= rank < world
        if transport not in ("shm", "tcp", "verbs"): raise RuntimeError(f"bad transport {transport}")
        if platform not in ("cpu", "cuda"): raise RuntimeError(f"bad platform {platform}")
        assert isinstance(secret, bytes) and len(secret) == 32
        assert all(isinstance(v, str) for v in options.values())
        if rank == fail_create_rank: raise RuntimeError("no memory for the slots")
        self.comm_id, self.device_ordinal, self.rank, self.world = comm_id, device_ordinal, rank, world
        self.transport, self.platform, self.name, self.secret = transport, platform, name, secret
        self.options = dict(options)
        self.connected = self.closed = False
        # The options and the plan are the real core's: a twin endpoint of
        # the real module (never connected; tcp, CPU) parses the options as
        # every endpoint does (an unknown key or a bad value raises) and
        # decides what runs each size (ffi/comm/plan.cc).
        from jax_arx import _core
        twin = dict(options)
        twin.pop("tcp_addr", None)
        self._real = _core.Endpoint(comm_id, device_ordinal, rank, world, "tcp", "cpu", name, secret, twin)
        endpoints.append(self)

    def details(self):
        return pickle.dumps(dict(comm_id=self.comm_id, rank=self.rank, world=self.world, secret=self.secret,
                                 transport=self.transport, options=self.options))

    def connect(self, all_details):
        ds = [pickle.loads(d) for d in all_details]
        if len(ds) != self.world: raise RuntimeError(f"got {len(ds)} details for world {self.world}")
        for r, d in enumerate(ds):
            for k in ("comm_id", "world", "secret", "transport"):
                if d[k] != getattr(self, k): raise RuntimeError(f"rank {r} disagrees on {k}")
            if d["rank"] != r: raise RuntimeError(f"details[{r}] are rank {d['rank']}'s")
            if d["options"].get("slot_bytes") != self.options.get("slot_bytes"):
                raise RuntimeError(f"rank {r} has another slot_bytes")
        # Like the real carriers, connect() returns only once every peer in
        # this process has started connecting too.
        key = (self.comm_id, self.secret)
        local = sum(1 for e in endpoints if (e.comm_id, e.secret) == key and not e.closed)
        with _cv:
            _connecting[key] = _connecting.get(key, 0) + 1
            _cv.notify_all()
            if not _cv.wait_for(lambda: _connecting[key] >= local, timeout=10):
                raise RuntimeError("timed out waiting for the local peers to connect")
        k = (self.comm_id, self.device_ordinal)
        if k in registered: raise RuntimeError(f"endpoint {k} registered twice")
        registered[k] = self
        self.connected = True

    def close(self):
        registered.pop((self.comm_id, self.device_ordinal), None)
        self._real.close()
        self.closed = True

    def failure(self):
        k = (self.comm_id, self.device_ordinal)
        return failed.get(k) or next((failed[p] for p in partners.get(k, ()) if p in failed), None)

    def fail_together(self, other):
        assert isinstance(other, Endpoint) and self.connected and other.connected, (self, other)
        a, b = (self.comm_id, self.device_ordinal), (other.comm_id, other.device_ordinal)
        assert a != b, a
        partners.setdefault(a, set()).add(b)
        partners.setdefault(b, set()).add(a)

    def plan(self, op, nbytes):
        return self._real.plan(op, nbytes)
'''


def body_prims(mesh, body, x, in_spec=None, out_spec=None, check_vma=True):
    """The primitives of ``body`` under shard_map over ``mesh`` (specs
    default to P("tp"))."""
    from jax.sharding import PartitionSpec as P

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=P("tp") if in_spec is None else in_spec,
        out_specs=P("tp") if out_spec is None else out_spec,
        check_vma=check_vma,
    )
    return prim_names(inner_jaxpr(jax.make_jaxpr(f)(x)))


def assert_bits_equal(a, b):
    """Every leaf of ``a`` and ``b``: the same dtype, shape and bytes."""
    import numpy as np

    def same(u, v):
        u, v = np.asarray(u), np.asarray(v)
        assert (u.dtype, u.shape, u.tobytes()) == (v.dtype, v.shape, v.tobytes()), (u, v)

    jax.tree.map(same, a, b)
