"""Chaos: kvbridge and the real Mooncake under the same failures, same client code, same run.

    benchmarks/run chaos [--quick] [--scenario NAME[,NAME...]] [--systems kvbridge,mooncake]
                         [--out DIR]

Per scenario and system: a fresh cluster (a master and 3 storage processes, each in a process
group of its own, killed as groups at the end), a steady put/get load from client processes
written once against Mooncake's MooncakeDistributedStore API (put_from / get_into / remove with
ReplicateConfig.replica_num = 2) and run with kvbridge.compat.mooncake or mooncake.store, every
get checked byte for byte, one failure injected at a fixed time, then a recovery window.
Scenarios (SCENARIOS below): kill -9 of a storage process, SIGSTOP of one for a while then
SIGCONT, kill -9 then a restart on the same ports, a graceful drain (SIGTERM), and kill -9 of
the master then a restart on the same port.

Figures per run: failed operations (errors, wrong bytes, acknowledged keys missing, calls
still hung at the end: each counted apart), seconds below half of the pre-failure throughput,
p50/p99 latency overall and in the failure window, time to recover, and a PNG timeline per
scenario with both systems (plot_chaos.py, drawn by --plot-python when this interpreter has no
matplotlib). Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from benchlib import emit, free_port, parser, percentile, ratio, rnd, wait_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BUCKET_S = 0.1
SMOOTH_BUCKETS = 5  # throughput is judged over a trailing 0.5 s, so one slow batch is no stall
NODES = 3
KIB = 1 << 10


# ------------------------------------------------------------------------------ scenarios

class Timing:
    """Seconds of one run: load starts at 0, the failure at `inject`, the load stops at
    `total`; `freeze` is how long a frozen process stays stopped, `down` how long a killed
    process stays dead before its restart; `window` the failure window the latency is
    reported for."""

    def __init__(self, quick: bool, tiny: bool = False):
        if tiny:  # the smoke test: figures are not meaningful, only their presence
            self.inject, self.total, self.freeze, self.down, self.window = 2.0, 5.0, 1.5, 0.5, 2.0
        elif quick:
            self.inject, self.total, self.freeze, self.down, self.window = 6.0, 24.0, 6.0, 1.0, 8.0
        else:
            self.inject, self.total, self.freeze, self.down, self.window = (
                15.0, 60.0, 15.0, 2.0, 20.0)
        self.warmup = min(1.0, self.inject / 3)


def inject_kill(c: "Cluster", t: Timing) -> list:
    c.signal_node(0, signal.SIGKILL)
    return [(0.0, "storage process 0 killed (kill -9)")]


def inject_freeze(c: "Cluster", t: Timing) -> list:
    c.signal_node(0, signal.SIGSTOP)
    time.sleep(t.freeze)
    c.signal_node(0, signal.SIGCONT)
    return [(0.0, "storage process 0 frozen (SIGSTOP)"), (t.freeze, "SIGCONT")]


def inject_restart(c: "Cluster", t: Timing) -> list:
    c.signal_node(0, signal.SIGKILL)
    time.sleep(t.down)
    c.start_node(0)
    return [(0.0, "storage process 0 killed (kill -9)"),
            (t.down, "restarted on the same ports")]


def inject_drain(c: "Cluster", t: Timing) -> list:
    c.drain_node(0)
    return [(0.0, "storage process 0 drained (SIGTERM)")]


def inject_master(c: "Cluster", t: Timing) -> list:
    return c.fail_master(t.down)


SCENARIOS: dict[str, tuple[str, Callable]] = {
    "kill-holder": ("kill -9 of a storage process holding replicas; it stays dead",
                    inject_kill),
    "freeze-holder": ("SIGSTOP of a storage process holding replicas, SIGCONT after the freeze "
                      "time (quick 6 s, full 15 s)", inject_freeze),
    "restart-holder": ("kill -9 of a storage process, restarted on the same ports after the "
                       "down time (quick 1 s, full 2 s), empty", inject_restart),
    "drain-holder": ("graceful removal of a storage process: SIGTERM (kvbridge: the node drains "
                     "its objects to the others and leaves; Mooncake: the process closes its "
                     "store, which unmounts its segment, and exits)", inject_drain),
    "kill-master": ("kill -9 of the master, restarted on the same port after the down time "
                    "(kvbridge: the leader of two masters electing one in etcd, when etcd is "
                    "installed; the restarted one comes back as a standby)", inject_master),
}

# What a reader needs to read a scenario's figures right.
NOTES = {
    "restart-holder": "kvbridge: the node comes back on the same data and RPC ports as a new "
                      "incarnation. Mooncake: the storage process comes back under the same "
                      "segment name (its store client port) with its transfer engine's "
                      "listeners in the same pinned four-port range.",
    "kill-master": "kvbridge runs two masters electing a leader in etcd (docs/ha.md): the "
                   "standby takes over after the leader's 2 s lease, rebuilds the object table "
                   "from the nodes' inventories and holds back only the chunks the old leader "
                   "published as being written (without etcd: one master restarted in place, "
                   "which holds every node back for the late-write hold); its clients get an 8 s "
                   "call deadline (KVBRIDGE_RPC_TIMEOUT_MS), as docs/ha.md asks of HA clients. "
                   "Mooncake's master "
                   "keeps object metadata in memory only (no HA or OpLog configured), so keys "
                   "stored before the restart are gone: its 'lost' count is that.",
}


# ------------------------------------------------------------------------------ processes

class Group:
    """A process started in a session (so a process group) of its own, logging to a file."""

    def __init__(self, argv: list, log: str, env: Optional[dict] = None, stdin=None):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdin=stdin, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


class Cluster:
    """A master and NODES storage processes of one system. start_node(i) (re)starts node i on
    its ports; fail_master() is the master's failure, kept in one place so that it can become
    "kill the leader among several masters" once the master is replicated."""

    system = ""

    def __init__(self, logdir: str, segment_bytes: int):
        self.logdir, self.segment = logdir, segment_bytes
        self.master: Optional[Group] = None
        self.nodes: list = [None] * NODES
        os.makedirs(logdir, exist_ok=True)

    def signal_node(self, i: int, sig: int) -> None:
        self.nodes[i].signal(sig)
        if sig == signal.SIGKILL:
            self.nodes[i].kill()

    def drain_node(self, i: int) -> None:
        os.kill(self.nodes[i].proc.pid, signal.SIGTERM)

    def fail_master(self, down_s: float) -> list:
        self.master.kill()
        time.sleep(down_s)
        self.start_master()
        return [(0.0, "master killed (kill -9)"), (down_s, "master restarted on the same port")]

    def close(self) -> None:
        for g in self.nodes + [self.master]:
            if g is not None:
                g.signal(signal.SIGCONT)
                g.kill()


ETCD = shutil.which("etcd") or ""
HA_MASTERS = 2


class KvbridgeCluster(Cluster):
    """`kvbridge master` and `kvbridge node` daemons from the build tree. With etcd installed
    (Debian etcd-server) the masters are HA_MASTERS of them electing a leader in a one-member
    etcd (docs/ha.md), and clients and nodes are given "etcd://...": fail_master kills the
    leader. Without etcd, one master, killed and restarted on its port."""

    system = "kvbridge"

    def __init__(self, logdir: str, segment_bytes: int, build: str):
        super().__init__(logdir, segment_bytes)
        self.binary = os.path.join(build, "bin", "kvbridge")
        if not os.access(self.binary, os.X_OK):
            raise RuntimeError(f"{self.binary} is not built (make build)")
        self.ha = bool(ETCD)
        self.master_ports = [free_port() for _ in range(HA_MASTERS if self.ha else 1)]
        self.http_ports = [free_port() for _ in self.master_ports]
        self.masters: list = [None] * len(self.master_ports)
        self.master_port = self.master_ports[0]
        self.node_ports = [(free_port(), free_port()) for _ in range(NODES)]
        self.etcd: Optional[Group] = None
        try:
            if self.ha:
                client, peer = free_port(), free_port()
                shutil.rmtree(os.path.join(logdir, "etcd-data"), ignore_errors=True)
                self.etcd = Group([ETCD, "--name", "chaos", "--data-dir",
                                   os.path.join(logdir, "etcd-data"),
                                   "--listen-client-urls", f"http://127.0.0.1:{client}",
                                   "--advertise-client-urls", f"http://127.0.0.1:{client}",
                                   "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                   "--initial-cluster", f"chaos=http://127.0.0.1:{peer}",
                                   "--logger=zap", "--log-level=error"],
                                  os.path.join(logdir, "etcd.log"))
                wait_port(client, 15, "etcd")
                self.address = f"etcd://127.0.0.1:{client}/chaos"
            else:
                self.address = f"127.0.0.1:{self.master_port}"
            for m in range(len(self.masters)):
                self.start_master(m)
            for i in range(NODES):
                self.start_node(i)
            # 60 s: once, on a loaded 2-core CI machine, an HA start (etcd, election, three
            # registrations) did not finish within 30 s; if it fails again, the error has
            # every process's log tail.
            self.wait_nodes(NODES, 60)
        except BaseException:
            self.close()
            raise

    def start_master(self, m: int = 0, wait: bool = True) -> None:
        listen = f"127.0.0.1:{self.master_ports[m]}"
        argv = [self.binary, "master", "--listen", listen, "--metrics-listen",
                f"127.0.0.1:{self.http_ports[m]}"]
        if self.ha:
            argv += ["--etcd", self.address[len("etcd://"):], "--ha-lease-ms", "2000"]
        self.masters[m] = Group(argv, os.path.join(self.logdir, f"master{m}.log"))
        self.master = self.masters[0]
        if wait and (not self.ha or m == 0):
            # An HA master listens once elected: after etcd is ready, which can take seconds.
            wait_port(self.master_ports[m], 30 if self.ha else 15, "kvbridge master")

    def fail_master(self, down_s: float) -> list:
        if not self.ha:
            return super().fail_master(down_s)
        m = self.leader_index()
        self.masters[m].kill()
        time.sleep(down_s)
        self.start_master(m, wait=False)  # a standby now: it listens only if elected
        return [(0.0, f"master leader killed (kill -9; {HA_MASTERS} masters, etcd)"),
                (down_s, "killed master restarted (a standby now)")]

    def leader_index(self) -> int:
        """The master whose /health says it serves (standbys answer 503)."""
        import urllib.error
        import urllib.request
        for m, port in enumerate(self.http_ports):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return m
            except (urllib.error.URLError, OSError):
                continue
        raise RuntimeError("kvbridge: no master says it leads (see the master logs)")

    def close(self) -> None:
        for g in self.masters[1:]:
            if g is not None:
                g.kill()
        super().close()
        if self.etcd is not None:
            self.etcd.kill()

    def start_node(self, i: int) -> None:
        data, rpc = self.node_ports[i]
        self.nodes[i] = Group([self.binary, "node", "--master", self.address, "--dram-bytes",
                               str(self.segment), "--node-id", f"chaos-node-{i}",
                               "--listen", f"127.0.0.1:{data}", "--rpc-listen",
                               f"127.0.0.1:{rpc}"], os.path.join(self.logdir, f"node{i}.log"))

    def wait_nodes(self, n: int, timeout_s: float) -> None:
        import kvbridge
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            try:
                st = kvbridge.cluster_status(self.address, 1000)
                if len(st["nodes"]) >= n:
                    return
                last = f"{len(st['nodes'])} of {n} nodes registered"
            except Exception as e:  # noqa: BLE001 - not up yet
                last = f"cluster_status: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvbridge: {n} nodes not registered within {timeout_s} s "
                                   f"(last seen: {last})\n{self.log_tails()}")
            time.sleep(0.1)

    def log_tails(self, lines: int = 8) -> str:
        """The last `lines` lines of every process log in logdir, for an error message."""
        out = []
        for name in sorted(os.listdir(self.logdir)):
            path = os.path.join(self.logdir, name)
            if not name.endswith(".log") or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                tail = f.read()[-4096:].decode(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(out)


class MooncakeCluster(Cluster):
    """The wheel's mooncake_master and 3 storage processes (MooncakeDistributedStore.setup with
    a global segment, this file's --storage mode). Each storage process is pinned to one store
    client port (its segment name 127.0.0.1:port) and a four-port range for its transfer
    engine's RPC and TCP data listeners, so a restart comes back under the same name and
    ports, as a restarted pod on fixed ports does."""

    system = "mooncake"

    def __init__(self, logdir: str, segment_bytes: int):
        super().__init__(logdir, segment_bytes)
        import mooncake
        self.binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        # Both ranges must lie outside the kernel's ephemeral range (Mooncake refuses them).
        self.master_port, self.metrics_port = free_port(20000, 29000), free_port(20000, 29000)
        # store client port, first of 4 transfer-engine ports (disjoint between the nodes)
        rpc = free_port(15000, 17000 - 4 * NODES)
        self.node_ports = [(free_port(12300, 14300), rpc + 4 * i) for i in range(NODES)]
        self.address = f"127.0.0.1:{self.master_port}"
        try:
            self.start_master()
            for i in range(NODES):
                self.start_node(i)
                self.wait_ready(i)
        except BaseException:
            self.close()
            raise

    def start_master(self) -> None:
        self.master = Group([self.binary, f"--rpc_port={self.master_port}",
                             "--rpc_address=127.0.0.1", f"--metrics_port={self.metrics_port}",
                             "--enable_metric_reporting=false",
                             # as bench_vs_mooncake: a short read lease so removes are not refused
                             "--default_kv_lease_ttl=200"],
                            os.path.join(self.logdir, "master.log"))
        wait_port(self.master_port, 15, "mooncake_master")

    def start_node(self, i: int) -> None:
        client_port, rpc = self.node_ports[i]
        env = dict(os.environ, MC_STORE_CLIENT_MIN_PORT=str(client_port),
                   MC_STORE_CLIENT_MAX_PORT=str(client_port), MC_MIN_RPC_PORT=str(rpc),
                   MC_MAX_RPC_PORT=str(rpc + 3))
        self.nodes[i] = Group([sys.executable, __file__, "--storage", "mooncake", "--master-addr",
                               self.address, "--bytes", str(self.segment), "--ready-file",
                               self.ready_file(i)], os.path.join(self.logdir, f"node{i}.log"),
                              env=env)

    def ready_file(self, i: int) -> str:
        return os.path.join(self.logdir, f"node{i}.ready")

    def wait_ready(self, i: int) -> None:
        deadline = time.monotonic() + 30
        while not os.path.exists(self.ready_file(i)):
            if self.nodes[i].proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake storage process {i} did not start "
                                   f"(see {self.logdir}/node{i}.log)")
            time.sleep(0.05)
        os.unlink(self.ready_file(i))


def serve_storage(master: str, segment: int, ready_file: str) -> int:
    """A Mooncake storage process: contributes `segment` bytes until killed; SIGTERM closes the
    store (Mooncake's graceful path: its segment is unmounted at the master) and exits."""
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(ready_file, "w") as f:
        f.write("ready\n")
    while not stop.wait(0.2):
        pass
    t = time.monotonic()
    store.close()
    print(f"closed the store in {time.monotonic() - t:.3f} s", flush=True)
    return 0


# ------------------------------------------------------------------------------- workload

def store_api(system: str):
    if system == "kvbridge":
        from kvbridge.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
    else:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    return MooncakeDistributedStore, ReplicateConfig


OBJECT_NOT_FOUND = -704
MIN_VALUE, MAX_VALUE = 64 * KIB, 1024 * KIB


def value_of(key: str, size: int) -> bytes:
    """The bytes stored under `key`: its 16-byte digest repeated, so that bytes of another key
    or a stale copy never pass the check."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest() * (size // 16)


def run_workload(system: str, master: str, threads: int, rate: float, replicas: int,
                 window_keys: int, seed: int, out: str) -> int:
    """A client process: setup, 'ready' on stdout, then on stdin 'go T0 T_END' (monotonic
    seconds) `threads` threads loop put_from of a new key / get_into of a key this thread was
    told is stored, `rate` of them a second, removing its oldest keys beyond `window_keys`,
    until T_END. Writes every
    operation (start, end, op, outcome, code, bytes) to `out` as JSON. Operations still in a
    call 3 s after T_END are written as "hung" and the process exits without waiting."""
    Store, Config = store_api(system)
    store = Store()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"ERROR setup {rc}", flush=True)
        return 1
    bufs = [ctypes.create_string_buffer(MAX_VALUE) for _ in range(threads)]
    for b in bufs:
        if store.register_buffer(ctypes.addressof(b), MAX_VALUE) != 0:
            print("ERROR register_buffer", flush=True)
            return 1
    print("ready", flush=True)
    go = sys.stdin.readline().split()
    t0, t_end = float(go[1]), float(go[2])
    records: list = []
    inflight: dict = {}
    config = Config()
    config.replica_num = replicas

    def loop(tid: int) -> None:
        rng = random.Random(seed * 1000 + tid)
        ptr = ctypes.addressof(bufs[tid])
        acked: collections.deque = collections.deque()
        n = 0
        interval = 1.0 / rate
        due = t0 + rng.random() * interval
        while True:
            # A steady offered load: one operation every `interval`; after a stall the thread
            # catches up on at most 0.5 s of missed operations.
            now = time.monotonic()
            due = max(due + interval, now - 0.5)
            if due > now:
                time.sleep(due - now)
            if time.monotonic() >= t_end:
                break
            if not acked or rng.random() < 0.5:
                size = rng.randrange(MIN_VALUE, MAX_VALUE + 1, 4 * KIB)
                key = f"chaos-{seed}-{tid}-{n}-{size}"
                n += 1
                ctypes.memmove(ptr, value_of(key, size), size)
                start = time.monotonic()
                inflight[tid] = (start, "put", size)
                rc = store.put_from(key, ptr, size, config)
                end = time.monotonic()
                outcome = "ok" if rc == 0 else "error"
                records.append((start - t0, end - t0, "put", outcome, rc, size))
                if rc == 0:
                    acked.append((key, size))
            else:
                key, size = acked[rng.randrange(len(acked))]
                ctypes.memset(ptr, 0, size)
                start = time.monotonic()
                inflight[tid] = (start, "get", size)
                rc = store.get_into(key, ptr, size)
                end = time.monotonic()
                if rc == size:
                    good = ctypes.string_at(ptr, size) == value_of(key, size)
                    outcome = "ok" if good else "wrong_bytes"
                elif rc == OBJECT_NOT_FOUND:
                    outcome = "lost"
                elif rc >= 0:
                    outcome = "wrong_bytes"  # a length that is not the value's
                else:
                    outcome = "error"
                records.append((start - t0, end - t0, "get", outcome, rc, size))
            inflight.pop(tid, None)
            while len(acked) > window_keys:
                old, _ = acked.popleft()
                start = time.monotonic()
                inflight[tid] = (start, "remove", 0)
                rc = store.remove(old)
                records.append((start - t0, time.monotonic() - t0, "remove",
                                "ok" if rc == 0 else "error", rc, 0))
                inflight.pop(tid, None)

    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=max(0.0, t_end + 3.0 - time.monotonic()))
    for start, op, size in list(inflight.values()):
        records.append((start - t0, None, op, "hung", None, size))
    with open(out + ".tmp", "w") as f:
        json.dump(records, f)
    os.replace(out + ".tmp", out)
    sys.stdout.flush()
    os._exit(0)  # a client stuck in a call must not hold the exit up


# -------------------------------------------------------------------------------- figures

FAILURES = ("error", "wrong_bytes", "lost", "hung")


def analyse(records: list, t: Timing, events: list) -> dict:
    """The figures of one run from its operation records (times relative to the load start;
    the failure at t.inject)."""
    ops = [r for r in records if r[2] in ("put", "get")]
    removes = [r for r in records if r[2] == "remove"]
    nb = int(round(t.total / BUCKET_S)) + 1
    ok_bytes, failed = [0] * nb, [0] * nb
    for start, end, _op, outcome, _rc, size in ops:
        at = end if end is not None else start
        b = min(nb - 1, max(0, int(at / BUCKET_S)))
        if outcome == "ok":
            ok_bytes[b] += size
        else:
            failed[b] += 1
    mbps = [x / BUCKET_S / 1e6 for x in ok_bytes]
    smooth = [sum(mbps[max(0, i - SMOOTH_BUCKETS + 1):i + 1]) / min(i + 1, SMOOTH_BUCKETS)
              for i in range(nb)]
    b_warm, b_inject = int(t.warmup / BUCKET_S), int(t.inject / BUCKET_S)
    b_end = int(t.total / BUCKET_S)
    base = mbps[b_warm:b_inject]
    baseline = sum(base) / len(base) if base else 0.0
    half = 0.5 * baseline

    def below(lo: int, hi: int) -> list:
        return [i for i in range(lo, hi) if smooth[i] < half]

    stalled = below(b_inject, b_end)
    noise = below(b_warm + SMOOTH_BUCKETS, b_inject)
    bad_after = [i for i in range(b_inject, b_end) if smooth[i] < half or failed[i]]
    recovered = not bad_after or bad_after[-1] < b_end - SMOOTH_BUCKETS
    recover_s = (rnd((bad_after[-1] + 1) * BUCKET_S - t.inject, 1) if bad_after else 0.0)
    counts = {k: sum(1 for r in ops if r[3] == k) for k in FAILURES}
    by_op = {op: {k: sum(1 for r in ops if r[2] == op and r[3] == k) for k in FAILURES}
             for op in ("put", "get")}

    def lat(sel: list) -> dict:
        done = [r[1] - r[0] for r in sel if r[1] is not None]
        return {"ops": len(sel), "p50_ms": ms(percentile(done, 50)),
                "p99_ms": ms(percentile(done, 99)), "max_ms": ms(percentile(done, 100))}

    in_window = [r for r in ops if t.inject <= r[0] < t.inject + t.window]
    codes = collections.Counter(str(r[4]) for r in ops if r[3] == "error")
    return {
        "failed_ops": sum(counts.values()),
        "failed": counts, "failed_by_op": by_op, "error_codes": dict(codes),
        "ops": len(ops), "ok_ops": sum(1 for r in ops if r[3] == "ok"),
        "gets_checked": sum(1 for r in ops if r[2] == "get" and r[3] in ("ok", "wrong_bytes")),
        "removes": len(removes), "removes_failed": sum(1 for r in removes if r[3] != "ok"),
        "baseline_mb_per_s": rnd(baseline, 1),
        "stall_seconds": rnd(len(stalled) * BUCKET_S, 1),
        "stall_seconds_before_failure": rnd(len(noise) * BUCKET_S, 1),
        "time_to_recover_s": recover_s if recovered else None,
        "recovered": recovered,
        "latency": lat(ops), "latency_failure_window": lat(in_window),
        "events": [{"t_s": rnd(t.inject + at, 2), "what": what} for at, what in events],
        "timeline": {"bucket_s": BUCKET_S, "mb_per_s": [rnd(x, 1) for x in mbps],
                     "failed_ops": failed},
    }


def ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(seconds * 1e3, 2)


# ------------------------------------------------------------------------------- one run

def run_one(system: str, scenario: str, t: Timing, args, logdir: str) -> dict:
    desc, inject = SCENARIOS[scenario]
    segment = args.segment_mib << 20
    if system == "kvbridge":
        cluster: Cluster = KvbridgeCluster(logdir, segment, args.build)
    else:
        cluster = MooncakeCluster(logdir, segment)
    env = dict(os.environ)
    if getattr(cluster, "ha", False):
        # As docs/ha.md asks of HA clients: a call's deadline above the leader's lease plus a
        # couple of seconds, so reads and puts ride through an election.
        env.setdefault("KVBRIDGE_RPC_TIMEOUT_MS", "8000")
    clients = []
    try:
        for w in range(args.clients):
            out = os.path.join(logdir, f"client{w}.json")
            p = subprocess.Popen([sys.executable, __file__, "--worker", system, "--master-addr",
                                  cluster.address, "--threads", str(args.threads),
                                  "--rate", str(args.rate), "--replicas", str(args.replicas),
                                  "--window-keys", str(args.window_keys),
                                  "--seed", str(w + 1), "--out", out],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(os.path.join(logdir, f"client{w}.log"), "ab"),
                                 text=True, env=env, start_new_session=True)
            clients.append((p, out))
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"{system} client {w}: {line!r} (see {logdir})")
        t0 = time.monotonic() + 0.2
        for p, _ in clients:
            p.stdin.write(f"go {t0} {t0 + t.total}\n")
            p.stdin.flush()
        time.sleep(max(0.0, t0 + t.inject - time.monotonic()))
        print(f"  {system}: {scenario} at t = {t.inject:.1f} s", file=sys.stderr)
        events = inject(cluster, t)
        records = []
        for p, out in clients:
            try:
                p.wait(timeout=max(1.0, t0 + t.total + 15 - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if os.path.exists(out):
                with open(out) as f:
                    records += json.load(f)
            else:
                raise RuntimeError(f"{system} client wrote no records (see {logdir})")
    finally:
        for p, _ in clients:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        cluster.close()
    res = analyse(records, t, events)
    f = res["failed"]
    print(f"  {system:8s} {scenario}: {res['ops']} ops, failed {res['failed_ops']} (errors "
          f"{f['error']}, wrong bytes {f['wrong_bytes']}, lost {f['lost']}, hung {f['hung']}), "
          f"stall {res['stall_seconds']} s, recover {res['time_to_recover_s']} s, p99 "
          f"{res['latency']['p99_ms']} ms", file=sys.stderr)
    return res


def plot(doc: dict, scenario: str, out_dir: str, python: Optional[str]) -> Optional[str]:
    """Writes <out_dir>/<scenario>.json (the timelines) and the PNG beside it; returns the
    PNG's path, or None (the reason on stderr) when no interpreter with matplotlib is at hand."""
    data = os.path.join(out_dir, f"{scenario}.json")
    png = os.path.join(out_dir, f"{scenario}.png")
    with open(data, "w") as f:
        json.dump(doc, f)
    py = python if python and os.access(python, os.X_OK) else sys.executable
    r = subprocess.run([py, os.path.join(HERE, "plot_chaos.py"), "--timeline", data, "--out",
                        png], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  no PNG for {scenario}: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return png


def main() -> int:
    ap = parser(__doc__, quick=f"each run {Timing(True).total:.0f} s of load (full: "
                f"{Timing(False).total:.0f} s)")
    ap.add_argument("--scenario", default=",".join(SCENARIOS),
                    help=f"comma-separated, of {', '.join(SCENARIOS)} (default all)")
    ap.add_argument("--systems", default="kvbridge,mooncake",
                    help="comma-separated, of kvbridge, mooncake")
    ap.add_argument("--out", default=os.path.join(REPO, "bench-out", "chaos"),
                    help="folder for the timelines, PNGs and process logs")
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--threads", type=int, default=2, help="threads per client process")
    ap.add_argument("--rate", type=float, default=20.0,
                    help="put/get operations a second per thread (half each, on average)")
    ap.add_argument("--replicas", type=int, default=2, help="ReplicateConfig.replica_num")
    ap.add_argument("--segment-mib", type=int, default=512,
                    help="memory each storage process contributes (MiB)")
    ap.add_argument("--window-keys", type=int, default=24,
                    help="keys each thread keeps stored (older ones are removed)")
    ap.add_argument("--build", default=os.environ.get("KVBRIDGE_BUILD_DIR"),
                    help="kvbridge build tree (default: the one the imported kvbridge is from)")
    ap.add_argument("--plot-python", default=None,
                    help="interpreter with matplotlib for the PNGs (default this one)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--storage", help=argparse.SUPPRESS)
    ap.add_argument("--master-addr", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.storage:
        return serve_storage(args.master_addr, args.bytes, args.ready_file)
    if args.worker:
        return run_workload(args.worker, args.master_addr, args.threads, args.rate, args.replicas,
                            args.window_keys, args.seed, args.out)

    # SIGTERM and SIGINT (which a shell ignores in a background job) end the run through the
    # finally blocks, so that no cluster outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    scenarios = [s for s in args.scenario.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"--scenario {s!r}: one of {', '.join(SCENARIOS)}")
    for s in systems:
        if s not in ("kvbridge", "mooncake"):
            ap.error(f"--systems {s!r}: kvbridge or mooncake")
    if args.build is None:
        import kvbridge
        # build/python/kvbridge/__init__.py -> build (not resolve(): the build stages symlinks)
        args.build = os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(kvbridge.__file__))))
    unavailable = {}
    if "mooncake" in systems:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as e:
            unavailable["mooncake"] = (f"Mooncake not importable: {e}; run "
                                       "scripts/setup_mooncake_venv.sh")
    t = Timing(args.quick, args.tiny)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {}
    for scenario in scenarios:
        print(f"{scenario}: {SCENARIOS[scenario][0]}", file=sys.stderr)
        per: dict = {}
        for system in systems:
            if system in unavailable:
                per[system] = {"error": unavailable[system]}
                continue
            logdir = os.path.join(args.out, "logs", f"{scenario}-{system}")
            try:
                per[system] = run_one(system, scenario, t, args, logdir)
            except Exception as e:  # noqa: BLE001 - a system that cannot run a scenario says so
                print(f"  {system}: {scenario} could not run: {e}", file=sys.stderr)
                per[system] = {"error": str(e)}
        timelines = {s: {"timeline": r["timeline"], "events": r["events"],
                         "failed_ops": r["failed_ops"], "stall_seconds": r["stall_seconds"]}
                     for s, r in per.items() if "timeline" in r}
        png = plot({"scenario": scenario, "description": SCENARIOS[scenario][0],
                    "inject_s": t.inject, "systems": timelines}, scenario, args.out,
                   args.plot_python) if timelines else None
        for r in per.values():
            r.pop("timeline", None)
        k, m = per.get("kvbridge", {}), per.get("mooncake", {})
        results[scenario] = {"description": SCENARIOS[scenario][0], "systems": per,
                             "note": NOTES.get(scenario),
                             "timeline_png": png,
                             "stall_seconds_ratio": ratio(k.get("stall_seconds"),
                                                          m.get("stall_seconds"))}
    failed = {s: sum(r["systems"][s].get("failed_ops", 0) for r in results.values())
              for s in systems}
    stall = {s: rnd(sum(r["systems"][s].get("stall_seconds", 0) for r in results.values()), 1)
             for s in systems}
    doc = {"benchmark": "chaos", "quick": args.quick,
           "config": {"inject_s": t.inject, "load_s": t.total, "freeze_s": t.freeze,
                      "down_s": t.down, "failure_window_s": t.window, "bucket_s": BUCKET_S,
                      "clients": args.clients, "threads_per_client": args.threads,
                      "ops_per_s_per_thread": args.rate,
                      "replica_num": args.replicas, "value_bytes": [MIN_VALUE, MAX_VALUE],
                      "storage_processes": NODES, "segment_mib": args.segment_mib,
                      "window_keys_per_thread": args.window_keys, "out": args.out},
           "scenarios": results,
           "headline": {"metric": "failed put/get operations over all scenarios (errors + "
                        "wrong bytes + acknowledged keys missing + calls hung at the end); "
                        "stall_seconds_ratio: seconds below half the pre-failure throughput, "
                        "kvbridge / Mooncake (lower is better for kvbridge)",
                        "value": failed.get("kvbridge"), "baseline": failed.get("mooncake"),
                        "baseline_name": "the real Mooncake wheel (mooncake_master + 3 storage "
                        "processes), same client code, same run",
                        "failed_ops": failed, "stall_seconds": stall,
                        "stall_seconds_ratio": ratio(stall.get("kvbridge"), stall.get("mooncake")),
                        "goal": "kvbridge failed_ops 0"}}
    emit(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
