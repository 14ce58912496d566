"""Hosts as network namespaces, one process in each (the jax.distributed
coordinator in the first), jax_arx over tcp (tests/workers/hosts.py checks
psum, all_gather and psum_scatter bit for bit).

- Two hosts joined by a veth pair: the automatic choice finds tcp.
- docs/multi-host.md's step 4 as written (the README's demo, then
  tp_decode) on two hosts whose host names resolve to their addresses only
  through the page's /etc/hosts lines.
- A switchless ring of four: each namespace is joined by veth pairs to its
  two neighbours only (no bridge, no forwarding), as boxes cabled in a ring.
  Each box's address for jax_arx (JAX_ARX_TCP_ADDR) sits on its loopback and
  is routed over the two links to the neighbours, so the rank two away has
  no path at all. jax.distributed's coordinator goes over a separate
  management network (a bridge in a fifth namespace, as the boxes' own
  Ethernet ports to a switch), which jax_arx's traffic never takes. A mesh
  must fail there on every rank within the timeout, saying there is no path
  to a rank; a ring must pass, every rank relaying for its previous one.

The namespaces get addresses from documentation ranges (198.51.100.0/24,
203.0.113.0/24) and no route out of the machine. The tests create and remove
them themselves; they need root and `ip netns`, and are skipped, saying why,
where they cannot (failed in CI: tests/needs.py).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import launched
import needs

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "hosts.py"
NET = "198.51.100"
MGMT = "203.0.113"
RING = 4

pytestmark = pytest.mark.netns


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class _Namespaces:
    """Namespaces and links made for one test, removed at the end
    (a namespace takes its interfaces with it)."""

    def __init__(self):
        if os.geteuid() != 0:
            needs.missing("network namespaces need root")
        if shutil.which("ip") is None:
            needs.missing("no `ip` command (apt-get install iproute2)")
        self.tag = uuid.uuid4().hex[:6]
        self.made: list[str] = []

    def add(self, name):
        name = f"{name}{self.tag}"
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            needs.missing(f"cannot create a network namespace: {r.stderr.strip()}")
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def wire(self, a, a_end, b, b_end):
        """A veth pair, end ``a_end`` in namespace a and ``b_end`` in b, both up."""
        a_end, b_end = f"{a_end}{self.tag}", f"{b_end}{self.tag}"
        _ip("link", "add", a_end, "type", "veth", "peer", "name", b_end)
        for ns, end in ((a, a_end), (b, b_end)):
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "link", "set", end, "up")
        return a_end, b_end

    def remove(self):
        for n in self.made:
            _ip("netns", "del", n, check=False)


@pytest.fixture
def two_hosts():
    nets = _Namespaces()
    try:
        names = [nets.add("arxA"), nets.add("arxB")]
        ends = nets.wire(names[0], "arxa", names[1], "arxb")
        for i, (n, v) in enumerate(zip(names, ends, strict=True)):
            _ip("-n", n, "addr", "add", f"{NET}.{i + 1}/24", "dev", v)
        yield names
    finally:
        nets.remove()


@pytest.fixture
def ring_of_four():
    """RING namespaces; returns (names, each one's jax_arx address, the
    coordinator's address)."""
    nets = _Namespaces()
    try:
        names = [nets.add(f"arxR{i}") for i in range(RING)]
        addr = [f"{NET}.{11 + i}" for i in range(RING)]
        for i, n in enumerate(names):
            _ip("-n", n, "addr", "add", f"{addr[i]}/32", "dev", "lo")
        for i in range(RING):  # link i: rank i's next port to rank i + 1's prev port
            j = (i + 1) % RING
            out, into = nets.wire(names[i], f"arn{i}", names[j], f"arp{j}")
            _ip("-n", names[i], "route", "add", f"{addr[j]}/32", "dev", out, "src", addr[i])
            _ip("-n", names[j], "route", "add", f"{addr[i]}/32", "dev", into, "src", addr[j])
        hub = nets.add("arxM")
        _ip("-n", hub, "link", "add", f"arbr{nets.tag}", "type", "bridge")
        _ip("-n", hub, "link", "set", f"arbr{nets.tag}", "up")
        for i, n in enumerate(names):
            end, port = nets.wire(n, f"arm{i}", hub, f"arh{i}")
            _ip("-n", n, "addr", "add", f"{MGMT}.{i + 1}/24", "dev", end)
            _ip("-n", hub, "link", "set", port, "master", f"arbr{nets.tag}")
        for n in names:  # nothing is forwarded: the rank two away stays out of reach
            subprocess.run(["ip", "netns", "exec", n, "sysctl", "-qw", "net.ipv4.ip_forward=0"], check=True)
        yield names, addr, f"{MGMT}.1"
    finally:
        nets.remove()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hosts(names, coordinator, args=(), env_of=lambda i: {}, timeout=300):
    """tests/workers/hosts.py in each namespace, process i in names[i];
    returns each one's JSON line, after checking that every process exited 0."""
    port = _free_port()
    procs = []
    for i, ns in enumerate(names):
        # A clean environment (no jax/XLA settings of the test process), and
        # no JAX_ARX_TRANSPORT: the automatic choice must find tcp.
        env = launched.clean_env(
            {
                "JAX_COORDINATOR_ADDRESS": f"{coordinator}:{port}",
                "JAX_NUM_PROCESSES": str(len(names)),
                "JAX_PROCESS_ID": str(i),
                "JAX_PLATFORMS": "cpu",
                "JAX_ARX_TIMEOUT_S": "60",
                "PYTHONUNBUFFERED": "1",
                **env_of(i),
            }
        )
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        line = [text for text in out.splitlines() if text.startswith("{")][-1]
        results.append(json.loads(line))
    return results


CHECKED = {"psum": 12, "all_gather": 12, "psum_scatter": 12}


def test_psum_across_two_hosts_over_tcp(two_hosts):
    results = _run_hosts(two_hosts, f"{NET}.1")
    for r in results:
        assert r["ok"] and r["checked"] == CHECKED, results
        assert r["transport"] == ["tcp"] and r["topology"] == "mesh", r


def test_switchless_ring_of_four(ring_of_four, summary_line):
    names, addr, coordinator = ring_of_four
    env_of = lambda timeout: lambda i: {"JAX_ARX_TCP_ADDR": addr[i], "JAX_ARX_TIMEOUT_S": timeout}
    # A mesh dials the rank two away, which has no path: every rank fails
    # initialize within its timeout (10 s), saying so and what to set.
    results = _run_hosts(names, coordinator, ["--topology", "mesh"], env_of("10"))
    for r in results:
        assert not r["ok"], results
        rank2 = (r["process"] + 2) % RING
        assert f"could not connect to rank {rank2}" in r["init_error"], r
        assert "no path to that rank" in r["init_error"] and "JAX_ARX_TOPOLOGY=ring" in r["init_error"], r
        assert r["seconds"] < 10 + 20, r  # the timeout, and start-up
    summary_line(
        f"netns ring of 4, mesh: every rank failed in {max(r['seconds'] for r in results):.1f} s at most; "
        f"rank 0: {results[0]['init_error'][:600]}"
    )
    # A ring: everything passes, and every rank relays for its previous one.
    results = _run_hosts(names, coordinator, ["--topology", "ring"], env_of("60"))
    for r in results:
        assert r["ok"] and r["checked"] == CHECKED, results
        assert r["transport"] == ["tcp"] and r["topology"] == "ring", r
        assert r["relayed"] > 0, r
    summary_line(
        f"netns ring of 4, ring: {results[0]['checked']} checked per rank, relayed "
        f"{[r['relayed'] for r in results]} puts"
    )


def _page_run_block():
    """docs/multi-host.md's commands for one box (section "4. Run": its
    first block) and the README's demo, which the page runs."""
    import test_docs

    page = ROOT / "docs" / "multi-host.md"
    text = page.read_text()
    start = text.index("## 4. Run")
    line = text[:start].count("\n") + 1
    runs = [b for b in test_docs.markdown_blocks(page) if int(b.where.rsplit(":", 1)[1]) > line]
    demo = next(b for b in test_docs.markdown_blocks(ROOT / "README.md") if b.kind == "python")
    return runs[0].code, demo.code


def test_the_multi_host_page_as_written(two_hosts, tmp_path, summary_line):
    """docs/multi-host.md's step 4, run as written on two boxes: network
    namespaces joined by a veth pair, each with a host name of its own that
    resolves to its address only through the /etc/hosts lines of step 2
    (``ip netns exec`` mounts /etc/netns/NAME/hosts over /etc/hosts; with
    the names on a loopback address instead, jax's gloo fails, status 134).
    The page's addresses become the namespaces', its python the test's."""
    code, demo = _page_run_block()
    assert "JAX_PROCESS_ID=0" in code and "10.0.0.1:12345" in code, code
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "psum_demo.py").write_text(demo)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    port = _free_port()
    hosts = "".join(f"{NET}.{i + 1} arxbox{i}\n" for i in range(2))
    made = []
    try:
        procs = []
        for i, ns in enumerate(two_hosts):
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            made.append(etc)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + hosts)
            script = (
                code.replace("10.0.0.1:12345", f"{NET}.1:{port}")
                .replace("JAX_PROCESS_ID=0", f"JAX_PROCESS_ID={i}")
                .replace(".venv/bin/python", sys.executable)
            )
            env = launched.clean_env({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
            procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "unshare",
                        "--uts",
                        "sh",
                        "-c",
                        f'hostname arxbox{i} && exec bash -euo pipefail -c "$0"',
                        script,
                    ],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=600)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    finally:
        for etc in made:
            shutil.rmtree(etc, ignore_errors=True)
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"box {i} failed (status {p.returncode}):\n{out[-6000:]}"
        assert "[2 2 2 2]" in out, f"box {i}: the demo did not print [2 2 2 2]:\n{out[-4000:]}"
    # tp_decode reports on process 0: the carrier, then its checks and times.
    assert "jax_arx over the tcp carrier" in outs[0], f"tp_decode did not run over tcp:\n{outs[0][-4000:]}"
    summary_line(
        "netns, docs/multi-host.md step 4 as written on two boxes: "
        + " | ".join(line for line in outs[0].splitlines() if "tp_decode" in line or "[2 2" in line)[:600]
    )
