"""The `kvbridge` console command as real processes (python -m kvbridge == the entry point):
master, node and status are the daemon program it execs (build/bin/kvbridge here)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, python_env, read_line


def kvb(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge", *args], env=python_env(),
                          capture_output=True, text=True, timeout=timeout)


def kvb_daemon(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvbridge", *args], env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture
def daemons():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_help_and_bad_usage():
    r = kvb("--help")
    assert r.returncode == 0
    for sub in ("master", "node", "status", "bench"):
        assert sub in r.stdout
    # master, node and status are the daemon's: its help lists its flags.
    r = kvb("master", "--help")
    assert r.returncode == 0 and "--min-replicas N" in r.stdout and "--config FILE" in r.stdout
    r = kvb("node", "--dram-bytes", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = kvb("node", "--no-such-flag", "1")
    assert r.returncode == 2 and "unknown flag --no-such-flag" in r.stderr
    r = kvb("master", "--node-ttl-ms", "4294967296")
    assert r.returncode == 2 and "is not a number" in r.stderr
    r = kvb("bench", "--pages", "0")
    assert r.returncode == 2 and "--pages must be >= 1" in r.stderr


def test_daemon_program_missing_is_named(tmp_path):
    """A package with no daemon program next to it (and no build tree around it) says so."""
    import kvbridge.cli

    pkg = tmp_path / "site" / "kvbridge"
    pkg.mkdir(parents=True)
    (pkg / "cli.py").write_text(Path(kvbridge.cli.__file__).read_text())
    r = subprocess.run([sys.executable, str(pkg / "cli.py"), "master"], capture_output=True,
                       text=True, timeout=60, env=python_env())
    assert r.returncode == 1
    assert "daemon program is missing" in r.stderr and str(pkg / "bin" / "kvbridge") in r.stderr


def test_status_of_absent_master_is_a_named_error():
    r = kvb("status", "--master", f"127.0.0.1:{free_port()}", "--timeout-ms", "500", "--json")
    assert r.returncode == 1
    err = json.loads(r.stdout.strip().splitlines()[-1])
    assert err["error"] in ("PEER_UNREACHABLE", "UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_master_nodes_status_bench_and_drain(daemons):
    port = free_port()
    master = kvb_daemon("master", "--listen", f"127.0.0.1:{port}", "--node-ttl-ms", "2000",
                        "--json")
    daemons.append(master)
    ready = json.loads(read_line(master))
    assert ready["event"] == "ready" and ready["address"] == f"127.0.0.1:{port}"
    # The allocator it names is the one mapped into it (tcmalloc when the build linked it).
    maps = Path(f"/proc/{master.pid}/maps").read_text()
    assert ready["allocator"] == ("tcmalloc" if "libtcmalloc" in maps else "system")
    # The lean port it gives is its own: it says the lean port's hello.
    with socket.create_connection(("127.0.0.1", ready["fast_port"]), timeout=10) as sock:
        assert sock.recv(4) == b"KVBH"
    addr = ready["address"]
    for name in ("cli-node-a", "cli-node-b"):
        node = kvb_daemon("node", "--master", addr, "--dram-bytes", "48M", "--node-id", name,
                          "--json")
        daemons.append(node)
        assert json.loads(read_line(node))["node_id"] == name

    st = json.loads(kvb("status", "--master", addr, "--json").stdout)
    assert sorted(n["node_id"] for n in st["nodes"]) == ["cli-node-a", "cli-node-b"]
    assert all(n["state"] == "ACTIVE" and n["capacity_bytes"] == 48 << 20 for n in st["nodes"])
    text = kvb("status", "--master", addr).stdout
    assert "cli-node-a" in text and "ACTIVE" in text and "48.0 MiB" in text

    r = kvb("bench", "--master", addr, "--pages", "256", "--page-kib", "16", "--batch", "64",
            "--json", "--progress")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["put"]["failed"] == 0 and out["get"]["failed"] == 0
    assert out["put"]["gbps"] > 0 and out["get"]["gbps"] > 0
    assert "get [" in r.stderr and "100.0%" in r.stderr  # the progress bar

    # SIGTERM drains node a gracefully: it exits 0, and the master lists only node b.
    node_a = daemons[1]
    node_a.send_signal(signal.SIGTERM)
    assert node_a.wait(timeout=30) == 0
    lines = [json.loads(ln) for ln in node_a.stdout.read().decode().splitlines() if ln.strip()]
    assert lines[-1]["event"] == "stopped" and lines[-1]["result"] == "drained"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = json.loads(kvb("status", "--master", addr, "--json").stdout)
        if [n["node_id"] for n in st["nodes"] if n["state"] == "ACTIVE"] == ["cli-node-b"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"node a still listed: {st}")
    # What node a held is remembered for when it comes back (one count, printed in both forms).
    assert isinstance(st["departed_copies"], int) and st["departed_copies"] >= 0
    text = kvb("status", "--master", addr).stdout
    assert f"copies remembered for nodes that left: {st['departed_copies']}" in text
    master.send_signal(signal.SIGINT)
    assert master.wait(timeout=15) == 0


def test_bench_on_an_embedded_cluster_prints_text():
    r = kvb("bench", "--pages", "128", "--page-kib", "8", "--batch", "32", "--replica-num", "2")
    assert r.returncode == 0, r.stderr
    assert "put:" in r.stdout and "get:" in r.stdout and "0 failed" in r.stdout
    assert "[" not in r.stderr  # no progress bar when stderr is not a terminal


def _http_get(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_daemons_serve_metrics_and_status_watches(daemons):
    """--metrics-listen on the console script's daemons; `status --watch --interval` redraws."""
    port, http_port, node_http = free_port(), free_port(), free_port()
    master = kvb_daemon("master", "--listen", f"127.0.0.1:{port}", "--metrics-listen",
                        f"127.0.0.1:{http_port}", "--json")
    daemons.append(master)
    ready = json.loads(read_line(master))
    assert ready["metrics_address"] == f"127.0.0.1:{http_port}"
    node = kvb_daemon("node", "--master", ready["address"], "--dram-bytes", "32M", "--node-id",
                      "cli-obs-node", "--metrics-listen", f"127.0.0.1:{node_http}", "--json")
    daemons.append(node)
    assert json.loads(read_line(node))["metrics_address"] == f"127.0.0.1:{node_http}"
    assert _http_get(http_port, "/health") == (200, "ok\n")
    assert _http_get(node_http, "/health") == (200, "ok\n")
    status, body = _http_get(http_port, "/metrics")
    assert status == 200 and 'kvbridge_master_nodes{state="ACTIVE"} 1' in body
    # An address given explicitly that is taken: a startup error naming it.
    busy = kvb("master", "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen",
               f"127.0.0.1:{http_port}", timeout=30)
    assert busy.returncode == 1 and f"cannot serve HTTP on 127.0.0.1:{http_port}" in busy.stderr
    # --watch: the table again and again until stopped.
    watch = subprocess.Popen([sys.executable, "-m", "kvbridge", "status", "--master",
                              ready["address"], "--watch", "--interval", "0.2"],
                             env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    time.sleep(3)
    watch.send_signal(signal.SIGINT)
    out, _ = watch.communicate(timeout=10)
    assert out.count("cli-obs-node") >= 2, out
    r = kvb("status", "--master", ready["address"], "--interval", "1")
    assert r.returncode == 2 and "--interval goes with --watch" in r.stderr


def test_embedded_master_serves_no_http_unless_asked():
    import kvbridge

    with kvbridge.Master(master_listen="127.0.0.1:0") as m:
        assert m.metrics_address == ""
    with kvbridge.Master(master_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0") as m:
        port = int(m.metrics_address.rsplit(":", 1)[1])
        assert _http_get(port, "/health") == (200, "ok\n")


def test_a_second_signal_stops_a_draining_node_at_once(daemons):
    """A drain that cannot finish (its master is gone) is cut short by SIGINT."""
    master = kvb_daemon("master", "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen",
                        "off", "--json")
    daemons.append(master)
    addr = json.loads(read_line(master))["address"]
    node = kvb_daemon("node", "--master", addr, "--dram-bytes", "16M", "--node-id", "cli-cut",
                      "--drain-timeout-ms", "60000", "--metrics-listen", "off", "--json")
    daemons.append(node)
    assert json.loads(read_line(node))["event"] == "ready"
    master.kill()
    master.wait()
    node.send_signal(signal.SIGTERM)
    assert json.loads(read_line(node))["event"] == "draining"
    node.send_signal(signal.SIGINT)
    assert node.wait(timeout=10) == 128 + signal.SIGINT
    assert b"during the drain, stopping at once" in node.stderr.read()
