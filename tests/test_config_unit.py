"""jax_arx.config: the JAX_ARX_* settings parsed, their defaults, and the
messages for bad values (the C++ option parser's too, through the real
core: tests/stand_in_core.py)."""

import pathlib

import pytest

import jax_arx
from jax_arx import _native, config

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- configuration -------------------------------------------------------------


def test_config_defaults():
    cfg = config.load({})
    assert cfg == config.Config()
    assert (cfg.timeout_s, cfg.idle_spin_ms, cfg.idle_nap_us) == (30.0, 200, 200)
    assert (cfg.slot_bytes, cfg.send_bytes) == (1 << 20, 4 << 20)
    assert (cfg.transport, cfg.fallback, cfg.on_failure, cfg.debug) == (None, "lax", "raise", False)


def test_config_parses_every_variable():
    cfg = config.load(
        {
            "JAX_ARX_TIMEOUT_S": "2.5",
            "JAX_ARX_IDLE_SPIN_MS": "0",
            "JAX_ARX_IDLE_NAP_US": "50",
            "JAX_ARX_TRANSPORT": "TCP",
            "JAX_ARX_FALLBACK": "error",
            "JAX_ARX_ON_FAILURE": "abort",
            "JAX_ARX_SLOT_BYTES": "64KiB",
            "JAX_ARX_SEND_BYTES": "2M",
            "JAX_ARX_TCP_ADDR": "198.51.100.7",
            "NCCL_IB_HCA": "mlx5_0",
            "JAX_ARX_IB_GID_INDEX": "3",
            "JAX_ARX_DEBUG": "yes",
        }
    )
    assert cfg.timeout_s == 2.5 and cfg.idle_spin_ms == 0 and cfg.idle_nap_us == 50
    assert cfg.transport == "tcp" and cfg.fallback == "error" and cfg.on_failure == "abort"
    assert cfg.slot_bytes == 65536 and cfg.send_bytes == 2 << 20
    assert cfg.tcp_addr == "198.51.100.7" and cfg.ib_hca == "mlx5_0" and cfg.ib_gid_index == 3 and cfg.debug
    assert config.load({"JAX_ARX_IB_HCA": "mlx5_1", "NCCL_IB_HCA": "mlx5_0"}).ib_hca == "mlx5_1"
    assert config.load({"JAX_ARX_TRANSPORT": ""}).transport is None  # empty means unset


def test_config_endpoint_options_are_strings_the_core_accepts():
    env = {
        "JAX_ARX_ON_FAILURE": "abort",
        "JAX_ARX_IB_GID_INDEX": "1",
        "JAX_ARX_IB_HCA": "mlx5_0",
        "JAX_ARX_ONESHOT_MAX_BYTES": "64K",
        "JAX_ARX_CUDA_DIRECT": "0",
        "JAX_ARX_CUDA_PEER_MEMORY": "1",
        "JAX_ARX_IB_TIMEOUT": "20",
        "JAX_ARX_PREFILL_SLOT_BYTES": "0",
    }
    cfg = config.load(env)
    options = cfg.endpoint_options("127.0.0.1", {"cuda_ll_max_bytes": 0, "cuda_chunk_bytes": 4096, "moe_fused": 1})
    assert all(isinstance(v, str) for v in options.values())
    # The real core's parser takes every one (it rejects unknown keys and bad values).
    core = _native.core()
    ep = core.Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, options)
    ep.close()
    with pytest.raises(RuntimeError, match="unknown endpoint option 'cuda_pipeline'"):
        core.Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, dict(options, cuda_pipeline="1"))
    with pytest.raises(ValueError, match="_tuning key 'chunk' is not one of"):
        cfg.endpoint_options(None, {"chunk": 1})
    assert options["abort_on_failure"] == "1" and options["tcp_addr"] == "127.0.0.1"
    assert options["slot_bytes"] == "1048576" and float(options["timeout_s"]) == 30.0
    assert "tcp_addr" not in config.Config().endpoint_options(None)


def test_config_topology():
    assert config.load({}).topology == "mesh" and "topology" not in config.Config().endpoint_options(None)
    cfg = config.load({"JAX_ARX_TOPOLOGY": "Ring"})
    assert cfg.topology == "ring" and cfg.endpoint_options(None)["topology"] == "ring"
    # initialize's argument overrides the variable, either way.
    assert config.with_topology(cfg, None) is cfg
    assert config.with_topology(cfg, "mesh").topology == "mesh"
    assert config.with_topology(config.load({}), "RING").topology == "ring"
    for bad in ("star", "", 4, True):
        with pytest.raises(
            jax_arx.ConfigError,
            match=r"initialize\(topology=.* is not accepted: use one of 'mesh', "
            r"'ring', or None for JAX_ARX_TOPOLOGY",
        ):
            config.with_topology(cfg, bad)
    # The real core takes the option, and refuses what Python would not hand it.
    core = pytest.importorskip("jax_arx._core", reason="needs the built C++ module")
    core.Endpoint(1, 0, 0, 4, "tcp", "cpu", "t", b"s" * 32, cfg.endpoint_options(None)).close()
    with pytest.raises(RuntimeError, match="neither 'mesh' nor 'ring'"):
        core.Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, {"topology": "star"})
    with pytest.raises(RuntimeError, match=r"5 ranks; a ring \(JAX_ARX_TOPOLOGY=ring\) takes 2 to 4"):
        core.Endpoint(1, 0, 0, 5, "tcp", "cpu", "t", b"s" * 32, {"topology": "ring"})


@pytest.mark.parametrize(
    "env,options",
    [
        ({}, {}),
        ({"JAX_ARX_CUDA_DIRECT": "0"}, {"cuda_direct": "0"}),
        ({"JAX_ARX_CUDA_DIRECT": "off"}, {"cuda_direct": "0"}),
        ({"JAX_ARX_CUDA_DIRECT": "1"}, {}),  # the default
        ({"JAX_ARX_CUDA_PEER_MEMORY": "1"}, {"cuda_peer_memory": "1"}),
        ({"JAX_ARX_CUDA_PEER_MEMORY": "no"}, {"cuda_peer_memory": "0"}),
        (
            {"JAX_ARX_CUDA_DIRECT": "false", "JAX_ARX_CUDA_PEER_MEMORY": "true"},
            {"cuda_direct": "0", "cuda_peer_memory": "1"},
        ),
    ],
)
def test_cuda_settings_reach_the_core_as_it_reads_them(env, options):
    # The strings the core's parser reads (ffi/base/config.cc; tests/cpp/test_config.cc
    # checks what it makes of them), and the core takes them.
    got = config.load(env).endpoint_options(None)
    assert {k: v for k, v in got.items() if k.startswith("cuda_")} == options
    _native.core().Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, got).close()


@pytest.mark.parametrize(
    "tuning,error",
    [
        ({"cuda_chunk_bytes": 100}, r"cuda_chunk_bytes \(100\) must be a multiple of 16"),
        ({"cuda_ll_max_bytes": -2}, r"cuda_ll_max_bytes \(-2\) must be -1 \(built in\), 0 \(off\) or a size"),
        ({"moe_fused": 2}, r"option moe_fused=2 is outside \[0, 1\]"),
        ({"norm_fused": 2}, r"option norm_fused=2 is outside \[0, 1\]"),
    ],
)
def test_cuda_tuning_the_core_refuses(tuning, error):
    options = config.load({}).endpoint_options(None, tuning)
    with pytest.raises(RuntimeError, match=error):
        _native.core().Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, options)


@pytest.mark.parametrize(
    "name,value,accepted",
    [
        ("JAX_ARX_TIMEOUT_S", "soon", "positive number"),
        ("JAX_ARX_TIMEOUT_S", "-1", "positive number"),
        ("JAX_ARX_IDLE_SPIN_MS", "1.5", "non-negative integer"),
        ("JAX_ARX_IDLE_NAP_US", "-3", "non-negative integer"),
        ("JAX_ARX_TRANSPORT", "rdma", "shm, tcp, verbs"),
        ("JAX_ARX_TOPOLOGY", "torus", "mesh, ring"),
        ("JAX_ARX_FALLBACK", "warn", "lax, error"),
        ("JAX_ARX_GRAD_SUMS", "off", "jax_arx, lax"),
        ("JAX_ARX_ON_FAILURE", "exit", "raise, abort"),
        ("JAX_ARX_SLOT_BYTES", "1MB", "binary suffix"),
        ("JAX_ARX_SLOT_BYTES", "100", "multiple of 16"),
        ("JAX_ARX_SEND_BYTES", "0", "multiple of 16"),
        ("JAX_ARX_TCP_ADDR", "myhost", "IPv4 address"),
        ("JAX_ARX_IB_GID_INDEX", "x", "non-negative integer"),
        ("JAX_ARX_DEBUG", "maybe", "use 1 or 0"),
        ("JAX_ARX_CUDA_DIRECT", "2", "use 1 or 0"),
        ("JAX_ARX_CUDA_PEER_MEMORY", "auto", "use 1 or 0"),
    ],
)
def test_config_rejects_bad_values_naming_the_variable(name, value, accepted):
    with pytest.raises(jax_arx.ConfigError, match=f"{name}='{value}' is not accepted.*{accepted}"):
        config.load({name: value})


# --- variables jax_arx does not know ---------------------------------------------


@pytest.mark.parametrize(
    "name,meant",
    [
        ("JAX_ARX_TIMEOUT", "JAX_ARX_TIMEOUT_S"),
        ("JAX_ARX_SLOTBYTES", "JAX_ARX_SLOT_BYTES"),
        ("JAX_ARX_TRANSPRT", "JAX_ARX_TRANSPORT"),
        ("jax_arx_timeout_s", "JAX_ARX_TIMEOUT_S"),  # the case of the name is a typo too
        ("JAX_ARX_SOAK_CALL", "JAX_ARX_SOAK_CALLS"),
    ],
)
@pytest.mark.parametrize("value", ["5", ""])  # set to empty is still set under a wrong name
def test_a_misspelled_variable_is_refused_naming_the_one_meant(name, meant, value):
    with pytest.raises(
        jax_arx.ConfigError,
        match=rf"^{name} \(did you mean {meant}\?\) is set, but jax_arx has no "
        r"such variable: rename it .* or unset it",
    ):
        config.load({name: value, "JAX_ARX_TIMEOUT_S": "5"})


def test_unknown_variables_are_all_named_and_a_stranger_gets_no_guess():
    with pytest.raises(jax_arx.ConfigError) as e:
        config.load({"JAX_ARX_ZZZ": "1", "JAX_ARX_IB_CHUNK_BYTE": "4K"})
    assert str(e.value).startswith(
        "JAX_ARX_IB_CHUNK_BYTE (did you mean JAX_ARX_IB_CHUNK_BYTES?; that one is "
        "retired, nothing reads it), JAX_ARX_ZZZ are set, but jax_arx has no such "
        "variables: rename each"
    ), e.value


def test_variables_read_elsewhere_in_the_project_are_no_typos():
    # The build's (CMake options, JAX_ARX_CUDA and JAX_ARX_VERBS from the
    # environment) and the tests': set in a build's or CI's environment.
    for name in (
        "JAX_ARX_CUDA",
        "JAX_ARX_VERBS",
        "JAX_ARX_TESTING",
        "JAX_ARX_TESTS",
        "JAX_ARX_PYTHON",
        "JAX_ARX_TSAN",
        "JAX_ARX_TRACE",
        "JAX_ARX_SOAK_CALLS",
    ):
        assert name in config.OTHER_READERS
        assert config.load({name: "ON"}) == config.Config()
    assert config.load({"NCCL_IB_HCA": "mlx5_0", "JAX_PLATFORMS": "cpu"}).ib_hca == "mlx5_0"  # not ours


def test_retired_variables_still_warn_once(monkeypatch, caplog):
    monkeypatch.setattr(config, "_warned", set())
    env = {name: "4096" for name in config.RETIRED}
    with caplog.at_level("WARNING", logger="jax_arx"):
        assert config.load(env) == config.Config()
        config.load(env)
    said = [r.getMessage() for r in caplog.records if "no longer a setting" in r.getMessage()]
    assert sorted(said) == sorted(
        f"{name} is no longer a setting (a benchmark decided it); it is ignored: unset it" for name in config.RETIRED
    )


def test_variables_lists_what_load_reads():
    # Every name load() asks the environment for, asked through a mapping
    # that writes them down: VARIABLES must be exactly those (a variable
    # read but not listed would be refused as a typo).
    asked = set()

    class Recording(dict):
        def get(self, name, default=None):
            asked.add(name)
            return default

        def __iter__(self):
            return iter(())

    config.load(Recording())
    assert {n for n in asked if n.startswith("JAX_ARX_")} - set(config.RETIRED) == set(config.VARIABLES)


def test_initialize_refuses_an_unknown_variable(monkeypatch):
    import jax
    import numpy as np

    monkeypatch.setenv("JAX_ARX_TIMEOUT", "5")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("typo_axis",))
    with pytest.raises(jax_arx.ConfigError, match=r"JAX_ARX_TIMEOUT \(did you mean JAX_ARX_TIMEOUT_S\?\)"):
        jax_arx.initialize(mesh)
