"""The job's processes meet before jax.distributed (jax_arx/_join.py): set-up
mistakes fail every started process within seconds, naming the address or
the rank.

In-process (ranks as threads, no jax): every rank arriving, a missing rank,
a wrong or unresolvable address, a taken port, two processes with one rank,
a different process count, a wrong secret, and strangers on the port that
must neither stall nor spoil the join. As processes
(``jax_arx.distributed_initialize()`` from the environment, as on two
boxes): a missing rank, a wrong address and a taken port, each failing every
started process well within 60 s with the message a user needs.
"""

import socket
import subprocess
import sys
import threading
import time

import pytest

import launched
from jax_arx import _join
from jax_arx.errors import InitializationError


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect_when_listening(address, bound_s=10.0):
    """A connection to ``address`` once rank 0 listens there (bounded)."""
    host, port = _join.split_address(address)
    deadline = time.monotonic() + bound_s
    while True:
        try:
            return socket.create_connection((host, port))
        except OSError:
            assert time.monotonic() < deadline, f"nothing listened at {address} within {bound_s} s"
            time.sleep(0.05)


def _run_ranks(ranks, address, n, timeout_s=5.0, secrets=None):
    """join() for each rank in ``ranks`` on a thread of its own; returns
    {rank: None or the InitializationError's text} and the seconds each took."""
    out, took = {}, {}

    def one(i, rank):
        start = time.monotonic()
        try:
            _join.join(address, n, rank, timeout_s, (secrets or {}).get(i))
            out[i] = None
        except InitializationError as e:
            out[i] = str(e)
        took[i] = time.monotonic() - start

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(3 * timeout_s + 10)
        assert not t.is_alive(), "a rank's join did not end within its bounds"
    return out, took


def test_every_rank_arrives():
    address = f"127.0.0.1:{_free_port()}"
    out, _ = _run_ranks([1, 2, 0, 3], address, 4)  # rank 0 not first: the others retry until it listens
    assert out == {0: None, 1: None, 2: None, 3: None}


def test_every_rank_arrives_with_the_job_secret():
    address = f"127.0.0.1:{_free_port()}"
    out, _ = _run_ranks([0, 1], address, 2, secrets={0: "s" * 20, 1: "s" * 20})
    assert out == {0: None, 1: None}


def test_the_port_is_free_again_for_jax_once_joined():
    port = _free_port()
    assert _run_ranks([0, 1], f"127.0.0.1:{port}", 2)[0] == {0: None, 1: None}
    with socket.create_server(("", port)):
        pass


def test_a_missing_rank_is_named_by_every_rank_that_came():
    address = f"127.0.0.1:{_free_port()}"
    out, took = _run_ranks([0, 1], address, 3, timeout_s=2.0)
    assert "rank 2 of 3 did not arrive at the coordinator 127.0.0.1" in out[0], out[0]
    assert "rank 0 at " + address in out[1] and "rank 2 of 3 did not arrive" in out[1], out[1]
    assert max(took.values()) < 2.0 + 5.0


def test_a_wrong_address_names_it():
    # The wrong port stays bound, never listening, for the whole test: a port
    # only found free could be taken meanwhile (a parallel test's server did,
    # in CI), and rank 1 would reach that instead of being refused.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        right, wrong = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{held.getsockname()[1]}"
        out = {}
        t = threading.Thread(target=lambda: out.update(zero=_run_ranks([0], right, 2, timeout_s=2.0)[0][0]))
        t.start()
        got, took = _run_ranks([1], wrong, 2, timeout_s=2.0)
        t.join(20)
    assert "could not reach the coordinator at " + wrong in got[0] and "Connection refused" in got[0], got[0]
    assert took[0] < 2.0 + 3.0
    assert "rank 1 of 2 did not arrive" in out["zero"], out["zero"]


def test_an_address_that_does_not_resolve_fails_at_once():
    start = time.monotonic()
    with pytest.raises(InitializationError, match="'no-such-box.invalid'.*does not resolve"):
        _join.join("no-such-box.invalid:12355", 2, 1, 30.0, None)
    with pytest.raises(InitializationError, match="is not host:port"):
        _join.join("10.0.0.1", 2, 1, 30.0, None)
    assert time.monotonic() - start < 20  # the resolver's own bound, not the join's 30 s


def test_a_taken_port_fails_rank_0_at_once_and_its_peer_names_the_address():
    with socket.create_server(("", 0)) as holder:  # a program holding the port; it accepts nothing
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        out, took = _run_ranks([0, 1], address, 2, timeout_s=2.0)
    assert "rank 0 cannot listen on port" in out[0] and "Another program holds it" in out[0], out[0]
    assert took[0] < 1.0
    assert "what listens there is not jax_arx's rank 0" in out[1], out[1]


def test_two_processes_with_one_rank_fail_all():
    address = f"127.0.0.1:{_free_port()}"
    out, _ = _run_ranks([0, 1, 1], address, 3)
    assert all("two processes say they are rank 1" in out[i] for i in (0, 1, 2)), out


def test_a_different_process_count_fails_all():
    address = f"127.0.0.1:{_free_port()}"
    out = {}

    def other():
        try:
            _join.join(address, 3, 1, 5.0, None)
        except InitializationError as e:
            out["one"] = str(e)

    t = threading.Thread(target=other)
    t.start()
    with pytest.raises(InitializationError, match="rank 1 of 3 .*rank 0 has JAX_NUM_PROCESSES=2"):
        _join.join(address, 2, 0, 5.0, None)
    t.join(20)
    assert "rank 0 has JAX_NUM_PROCESSES=2" in out["one"]


def test_a_rank_without_the_secret_does_not_count():
    address = f"127.0.0.1:{_free_port()}"
    out, _ = _run_ranks([0, 1], address, 2, timeout_s=2.0, secrets={0: "a" * 20, 1: "b" * 20})
    assert "rank 1 of 2 did not arrive" in out[0], out[0]
    assert "without an answer" in out[1] and "JAX_ARX_SECRET" in out[1], out[1]


def test_strangers_on_the_port_neither_stall_nor_spoil_the_join():
    port = _free_port()
    address = f"127.0.0.1:{port}"
    result = {}
    zero = threading.Thread(target=lambda: result.update(zero=_run_ranks([0], address, 3, timeout_s=10.0)[0][0]))
    zero.start()
    strangers = [_connect_when_listening(address)]
    silent = strangers[0]  # connects and says nothing
    for line in (b"x" * 1000, b"rank 2 of 3 deadbeef\n", b"rank 9 of\n"):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(line)
        strangers.append(s)
    # Without a secret a stranger can say it is rank 1; the real rank 1 then
    # fails the job loudly. Here the strangers say nothing or garbage.
    silent.recv(100)
    out, took = _run_ranks([1, 2], address, 3, timeout_s=10.0)
    zero.join(30)
    assert out == {0: None, 1: None} and result["zero"] is None, (out, result)
    assert max(took.values()) < 5.0
    for s in strangers:
        s.close()


def test_a_stranger_posing_as_a_rank_fails_the_job_loudly_without_a_secret():
    address = f"127.0.0.1:{_free_port()}"
    result = {}
    zero = threading.Thread(target=lambda: result.update(zero=_run_ranks([0], address, 2, timeout_s=10.0)[0][0]))
    zero.start()
    with _connect_when_listening(address) as s:
        s.recv(100)
        s.sendall(b"rank 1 of 2 -\n")
        assert s.recv(100) == b"ok\n"  # it is taken for rank 1: without a secret nothing tells them apart
    zero.join(30)
    assert result["zero"] is None
    # ... and with one, the same bytes count for nothing.
    address = f"127.0.0.1:{_free_port()}"
    zero = threading.Thread(
        target=lambda: result.update(zero=_run_ranks([0], address, 2, timeout_s=2.0, secrets={0: "k" * 20})[0][0])
    )
    zero.start()
    with _connect_when_listening(address) as s:
        s.recv(100)
        s.sendall(b"rank 1 of 2 -\n")
        s.settimeout(10)
        assert s.recv(100) == b""  # dropped
    zero.join(30)
    assert "rank 1 of 2 did not arrive" in result["zero"]


# --- as processes, the way two boxes run it ------------------------------------------

PROGRAM = "import jax_arx\njax_arx.distributed_initialize()\nprint('joined', flush=True)\n"


def _start(tmp_path, address, n, rank, join_timeout="5"):
    env = launched.clean_env(
        {
            "JAX_COORDINATOR_ADDRESS": address,
            "JAX_NUM_PROCESSES": str(n),
            "JAX_PROCESS_ID": str(rank),
            "JAX_ARX_JOIN_TIMEOUT_S": join_timeout,
            "JAX_PLATFORMS": "cpu",
        }
    )
    return subprocess.Popen(
        [sys.executable, "-c", PROGRAM],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _ends(procs, bound_s=60):
    """Each process's (status, output, seconds), each within ``bound_s``."""
    start, out = time.monotonic(), []
    for p in procs:
        text, _ = p.communicate(timeout=max(1, bound_s - (time.monotonic() - start)))
        out.append((p.returncode, text, time.monotonic() - start))
    return out


@pytest.fixture
def installed(core_built):
    return core_built


def test_processes_a_missing_rank(tmp_path, installed):
    address = f"127.0.0.1:{_free_port()}"
    (s0, o0, _), (s1, o1, _) = _ends([_start(tmp_path, address, 3, 0), _start(tmp_path, address, 3, 1)])
    assert s0 != 0 and "InitializationError" in o0 and "rank 2 of 3 did not arrive" in o0, o0[-2000:]
    assert s1 != 0 and "rank 2 of 3 did not arrive" in o1 and address in o1, o1[-2000:]
    assert "joined" not in o0 + o1


def test_processes_a_wrong_address(tmp_path, installed):
    right, wrong = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    (s0, o0, _), (s1, o1, _) = _ends([_start(tmp_path, right, 2, 0), _start(tmp_path, wrong, 2, 1)])
    assert s0 != 0 and "rank 1 of 2 did not arrive at the coordinator " + right in o0, o0[-2000:]
    assert s1 != 0 and "could not reach the coordinator at " + wrong in o1, o1[-2000:]


def test_processes_a_taken_port(tmp_path, installed):
    with socket.create_server(("", 0)) as holder:
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        (s0, o0, t0), (s1, o1, _) = _ends([_start(tmp_path, address, 2, 0), _start(tmp_path, address, 2, 1)])
    assert s0 != 0 and "rank 0 cannot listen on port" in o0 and "SIGSEGV" not in o0, o0[-2000:]
    assert s1 != 0 and "not jax_arx's rank 0" in o1 and address in o1, o1[-2000:]


def test_processes_that_all_arrive_join(tmp_path, installed):
    address = f"127.0.0.1:{_free_port()}"
    ends = _ends([_start(tmp_path, address, 2, 1, "30"), _start(tmp_path, address, 2, 0, "30")], bound_s=120)
    assert all(s == 0 and "joined" in o for s, o, _ in ends), [o[-2000:] for _, o, _ in ends]


def test_one_process_has_nothing_to_join(tmp_path, installed):
    # JAX_NUM_PROCESSES=1: no join, no port bound (the address may be anything).
    ((s, o, _),) = _ends([_start(tmp_path, "127.0.0.1:1", 1, 0)])
    assert s == 0 and "joined" in o, o[-2000:]
