"""kvbridge against the real Mooncake, same Python code, same run, loopback TCP.

    benchmarks/run vs-mooncake [--quick]

(a) transfer: batch_transfer_sync_write / _read between two processes (a server process per
    system registers a buffer; this process drives it through the Mooncake TransferEngine API:
    kvbridge.compat.mooncake.TransferEngine or mooncake.engine.TransferEngine), blocks of
    64 KiB .. 4 MiB, batches of `--batch` blocks, p50/p99 per batch; and, as the loopback
    limit of one synchronous stream, a raw-socket baseline moving each batch as ONE request
    over one plain TCP connection ("ratio_vs_raw_socket" for kvbridge,
    "gbps_mooncake_over_raw_socket" for Mooncake);
(b) store: a master plus two storage processes per system (kvbridge: a kvbridge master;
    Mooncake: its mooncake_master), this process a pure client: batch_put_from then
    batch_get_into of 128 x 64 KiB pages per iteration through MooncakeDistributedStore
    (kvbridge.compat.mooncake or mooncake.store), replica_num 1 and 2.

Runs with an interpreter that imports both (scripts/setup_mooncake_venv.sh makes
.venv-mooncake; PYTHONPATH points at the kvbridge build). Progress on stderr; the last stdout
line is one JSON object with kvbridge/Mooncake ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

from benchlib import emit, gbps, parser, percentile, positive_int, ratio, rnd


def engine_class(impl: str):
    if impl == "kvbridge":
        from kvbridge.compat.mooncake import TransferEngine
    else:
        from mooncake.engine import TransferEngine
    return TransferEngine


def aligned(n: int):
    raw = ctypes.create_string_buffer(n + 4096)
    return raw, (ctypes.addressof(raw) + 4095) & ~4095


def serve(impl: str, nbytes: int) -> None:
    """Server process: an engine with one registered buffer; prints 'session addr'."""
    eng = engine_class(impl)()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print("ERROR initialize", flush=True)
        return
    raw, addr = aligned(nbytes)
    ctypes.memset(addr, 7, nbytes)
    if eng.register_memory(addr, nbytes) != 0:
        print("ERROR register", flush=True)
        return
    print(f"127.0.0.1:{eng.get_rpc_port()} {addr}", flush=True)
    sys.stdin.readline()  # until the driver closes stdin


def store_class(impl: str):
    if impl == "kvbridge":
        from kvbridge.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
    else:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    return MooncakeDistributedStore, ReplicateConfig


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_master(impl: str) -> None:
    """kvbridge's master in a process of its own (Mooncake's is its mooncake_master binary)."""
    import kvbridge
    m = kvbridge.Master(master_listen="127.0.0.1:0", lease_ms=200)
    print(m.address, flush=True)
    sys.stdin.readline()
    m.close()


def serve_storage(impl: str, master: str, segment: int) -> None:
    """A storage process: contributes `segment` bytes to the pool, serves until stdin closes."""
    cls, _ = store_class(impl)
    store = cls()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master)
    print("ready" if rc == 0 else f"ERROR setup {rc}", flush=True)
    sys.stdin.readline()
    store.close()


def start_master(impl: str):
    if impl == "kvbridge":
        p = subprocess.Popen([sys.executable, __file__, "--master", impl], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return p.stdout.readline().strip(), p
    import mooncake
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port = free_port()
    p = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                          f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1",
                          "--enable_metric_reporting=false", "--default_kv_lease_ttl=200"],
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, text=True)
    import socket
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake_master did not start") from e
            time.sleep(0.05)
    return f"127.0.0.1:{port}", p


def stop(p) -> None:
    try:
        p.stdin.close()
    except Exception:  # noqa: BLE001
        pass
    try:
        p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()


class StoreUnderTest:
    """One system's store: a master, two storage processes and this process as a client, kept
    up across rounds so that the systems can be measured in turn."""

    page, batch = 64 << 10, 128

    def __init__(self, impl: str, segment: int):
        self.impl, self.segment = impl, segment
        self.master, self.mproc = start_master(impl)
        self.nodes = []
        try:
            for _ in range(2):
                n = subprocess.Popen([sys.executable, __file__, "--storage", impl,
                                      "--master-addr", self.master, "--bytes", str(segment)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
                self.nodes.append(n)
                line = n.stdout.readline().strip()
                if line != "ready":
                    raise RuntimeError(f"{impl} storage process: {line!r}")
            cls, self.config_cls = store_class(impl)
            self.client = cls()
            assert self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                                     self.master) == 0
            span = self.page * self.batch
            self.src_raw, src = aligned(span)
            self.dst_raw, dst = aligned(span)
            ctypes.memset(src, 0x3C, span)
            assert self.client.register_buffer(src, span) == 0
            assert self.client.register_buffer(dst, span) == 0
            self.ptr_src = [src + i * self.page for i in range(self.batch)]
            self.ptr_dst = [dst + i * self.page for i in range(self.batch)]
        except BaseException:
            self.close()
            raise

    def measure(self, seconds: float, rnd: int) -> list[dict]:
        """batch_put_from then batch_get_into of 128 pages per iteration, replica_num 1 and 2,
        `seconds` each; the pool is emptied after each."""
        page, batch, impl = self.page, self.batch, self.impl
        sizes = [page] * batch
        rows = []
        for replicas in (1, 2):
            config = self.config_cls()
            config.replica_num = replicas
            # Stay well inside the pool (2 x segment): no eviction in the measurement.
            max_iters = max(1, int(0.7 * 2 * self.segment / (page * batch * replicas)))
            put_lat, get_lat, failed = [], [], 0
            t_end = time.perf_counter() + seconds
            it = 0
            while time.perf_counter() < t_end and it < max_iters:
                keys = [f"vs-{impl}-{rnd}-r{replicas}-{it}-{i}" for i in range(batch)]
                t = time.perf_counter()
                res = self.client.batch_put_from(keys, self.ptr_src, sizes, config)
                put_lat.append(time.perf_counter() - t)
                failed += sum(1 for r in res if r != 0)
                t = time.perf_counter()
                got = self.client.batch_get_into(keys, self.ptr_dst, sizes)
                get_lat.append(time.perf_counter() - t)
                failed += sum(1 for r in got if r != page)
                it += 1
            for op, lat in (("batch_put_from", put_lat), ("batch_get_into", get_lat)):
                rows.append(phase_row({"system": impl, "op": op, "replica_num": replicas,
                                       "pages": batch, "page_bytes": page},
                                      page * batch, lat, sum(lat), failed))
            time.sleep(0.3)  # past the read leases
            self.client.remove_all()
        return rows

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
        for n in self.nodes:
            stop(n)
        stop(self.mproc)


def serve_raw(nbytes: int) -> None:
    """Raw-socket baseline server: per request (op byte, length u64), 'R' sends `length` bytes,
    'W' receives them and answers one byte. Prints its port; one client at a time."""
    import socket
    import struct
    buf = bytearray(nbytes)
    view = memoryview(buf)
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(9)
    while True:
        if recv_exact(conn, memoryview(hdr)) == 0:
            return
        op, n = hdr[0], struct.unpack_from("<Q", hdr, 1)[0]
        if op == ord("R"):
            conn.sendall(view[:n])
        else:
            recv_exact(conn, view[:n])
            conn.sendall(b"k")


def recv_exact(sock, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return 0
        got += n
    return got


def bench_raw(sizes: list[int], batch: int, seconds: float) -> list[dict]:
    """The loopback limit for one synchronous stream: each batch as ONE request of
    size x batch bytes over one plain TCP connection (no per-block framing, no lanes)."""
    import socket
    import struct
    span = max(sizes) * batch
    server = subprocess.Popen([sys.executable, __file__, "--serve-raw", "--bytes", str(span)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL)
    port = int(server.stdout.readline())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(span)
    view = memoryview(buf)
    ack = bytearray(1)
    rows = []
    try:
        for size in sizes:
            n = size * batch
            for op in ("write", "read"):
                def once(op=op, n=n):
                    sock.sendall(struct.pack("<BQ", ord("W" if op == "write" else "R"), n))
                    if op == "write":
                        sock.sendall(view[:n])
                        recv_exact(sock, memoryview(ack))
                    else:
                        recv_exact(sock, view[:n])
                once()
                lat = []
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    t = time.perf_counter()
                    once()
                    lat.append(time.perf_counter() - t)
                rows.append(phase_row({"system": "raw_socket", "op": op, "block_bytes": size,
                                       "batch": batch}, n, lat, time.perf_counter() - t0, 0))
    finally:
        sock.close()
        server.wait(timeout=10)
    return rows


def phase_row(fields: dict, batch_bytes: int, lat: list[float], total: float,
              failed: int) -> dict:
    """One measured phase: `fields` name it (system, op, size...), `lat` holds the batch
    latencies, `total` the time the GB/s figure is over. `_lat`, `_total` and `_bytes` let
    merge_rounds pool the phases of several rounds."""
    r = {**fields,
         "gbps": rnd(gbps(batch_bytes * len(lat), total)),
         "p50_ms": ms(percentile(lat, 50)),
         "p99_ms": ms(percentile(lat, 99)),
         "batches": len(lat), "failures": failed,
         "_lat": lat, "_total": total, "_bytes": batch_bytes}
    what = fields.get("block_bytes")
    what = f"{what >> 10:5d} KiB" if what else f"r{fields.get('replica_num')}"
    print(f"  {fields['system'][:8]:8s} {fields['op']:15s} {what}: {r['gbps']:7.3f} GB/s "
          f"p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms, {failed} failed", file=sys.stderr)
    return r


def merge_rounds(rows: list[dict]) -> list[dict]:
    """Pools the phases of one row (same fields but the measured ones) over the rounds: GB/s
    over the summed time, percentiles over every batch."""
    measured = {"gbps", "p50_ms", "p99_ms", "batches", "failures", "_lat", "_total", "_bytes"}
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = tuple(sorted((k, v) for k, v in r.items() if k not in measured))
        m = merged.setdefault(key, {**r, "_lat": [], "_total": 0.0, "failures": 0, "rounds": 0})
        m["_lat"] = m["_lat"] + r["_lat"]
        m["_total"] += r["_total"]
        m["failures"] += r["failures"]
        m["rounds"] += 1
    out = []
    for m in merged.values():
        lat, total, nbytes = m.pop("_lat"), m.pop("_total"), m.pop("_bytes")
        m.update(gbps=rnd(gbps(nbytes * len(lat), total)),
                 p50_ms=ms(percentile(lat, 50)),
                 p99_ms=ms(percentile(lat, 99)), batches=len(lat))
        out.append(m)
    return out


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds, 3 decimals; None (no batch) stays None."""
    return None if seconds is None else round(seconds * 1e3, 3)


def bench_transfer(impl: str, sizes: list[int], batch: int, seconds: float) -> list[dict]:
    span = max(sizes) * batch
    env = dict(os.environ)
    server = subprocess.Popen([sys.executable, __file__, "--serve", impl, "--bytes", str(span)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                              stderr=subprocess.DEVNULL)
    line = server.stdout.readline().split()
    if len(line) != 2:
        server.kill()
        raise RuntimeError(f"{impl} server did not start: {line}")
    session, remote = line[0], int(line[1])
    eng = engine_class(impl)()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    raw, local = aligned(span)
    assert eng.register_memory(local, span) == 0
    rows = []
    try:
        for size in sizes:
            locs = [local + i * size for i in range(batch)]
            rems = [remote + i * size for i in range(batch)]
            lens = [size] * batch
            for op in ("write", "read"):
                fn = (eng.batch_transfer_sync_write if op == "write"
                      else eng.batch_transfer_sync_read)
                assert fn(session, locs, rems, lens) == 0  # warm-up (connections, handshake)
                lat, failed = [], 0
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    t = time.perf_counter()
                    failed += fn(session, locs, rems, lens) != 0
                    lat.append(time.perf_counter() - t)
                rows.append(phase_row({"system": impl, "op": op, "block_bytes": size,
                                       "batch": batch}, size * batch, lat,
                                      time.perf_counter() - t0, failed))
    finally:
        server.stdin.close()
        server.wait(timeout=10)
        if hasattr(eng, "close"):
            eng.close()
    return rows


def main() -> int:
    ap = parser(__doc__, quick="0.5 s per phase, 1 round (unless given)",
                seconds="seconds per phase, over all rounds (default 3, --quick 0.5)",
                rounds="alternate the systems this many times, each phase getting "
                "seconds/rounds, and pool the rounds (default 3, --quick 1), so that load "
                "drifting on the machine weighs on every system alike")
    ap.add_argument("--batch", type=positive_int, default=16, help="blocks per transfer batch")
    ap.add_argument("--segment-mib", type=positive_int, default=1024,
                    help="bytes each storage process contributes (MiB)")
    ap.add_argument("--only", choices=("transfer", "store"),
                    help="run one part only (the headline needs the store part)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--storage", help=argparse.SUPPRESS)
    ap.add_argument("--master-addr", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.bytes)
        return 0
    if args.serve_raw:
        serve_raw(args.bytes)
        return 0
    if args.master:
        serve_master(args.master)
        return 0
    if args.storage:
        serve_storage(args.storage, args.master_addr, args.bytes)
        return 0
    seconds = args.seconds or (0.5 if args.quick else 3.0)
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        print(json.dumps({"benchmark": "vs-mooncake", "error": f"Mooncake not importable: {e}; "
                          "run scripts/setup_mooncake_venv.sh"}))
        return 1
    if args.only != "store":
        print("transfer: batch_transfer_sync_write/read, two processes, loopback TCP",
              file=sys.stderr)
    rounds = max(1, args.rounds or (1 if args.quick else 3))
    rows, raw_rows = [], []
    for rd in range(rounds if args.only != "store" else 0):
        print(f" round {rd + 1} of {rounds}", file=sys.stderr)
        for impl in ("kvbridge", "mooncake"):
            rows += bench_transfer(impl, sizes, args.batch, seconds / rounds)
        raw_rows += bench_raw(sizes, args.batch, seconds / rounds)
    rows, raw_rows = merge_rounds(rows), merge_rounds(raw_rows)
    ratios = []
    for r in rows:
        if r["system"] != "kvbridge":
            continue
        m = next(x for x in rows if x["system"] == "mooncake" and x["op"] == r["op"]
                 and x["block_bytes"] == r["block_bytes"])
        raw = next((x for x in raw_rows if x["op"] == r["op"]
                    and x["block_bytes"] == r["block_bytes"]), None)
        raw_gbps = raw["gbps"] if raw else None
        ratios.append({"op": r["op"], "block_bytes": r["block_bytes"],
                       "ratio": ratio(r["gbps"], m["gbps"]),
                       "p99_kvbridge_over_mooncake": ratio(r["p99_ms"], m["p99_ms"]),
                       "ratio_vs_raw_socket": ratio(r["gbps"], raw_gbps),
                       "gbps_mooncake_over_raw_socket": ratio(m["gbps"], raw_gbps)})
    small = [x["ratio"] for x in ratios if x["block_bytes"] <= (1 << 20) and x["ratio"]]
    if args.only != "transfer":
        print("store: 2 storage processes + master per system, 128 x 64 KiB pages per batch",
              file=sys.stderr)
    srows = []
    if args.only != "transfer":
        stores = []
        try:
            for impl in ("kvbridge", "mooncake"):
                stores.append(StoreUnderTest(impl, args.segment_mib << 20))
            for rd in range(rounds):
                print(f" round {rd + 1} of {rounds}", file=sys.stderr)
                for st in stores:
                    srows += st.measure(seconds / rounds, rd)
        finally:
            for st in stores:
                st.close()
        srows = merge_rounds(srows)
    sratios = []
    for r in srows:
        if r["system"] != "kvbridge":
            continue
        m = next(x for x in srows if x["system"] == "mooncake" and x["op"] == r["op"]
                 and x["replica_num"] == r["replica_num"])
        sratios.append({"op": r["op"], "replica_num": r["replica_num"],
                        "ratio": ratio(r["gbps"], m["gbps"]),
                        "p99_kvbridge_over_mooncake": ratio(r["p99_ms"], m["p99_ms"]),
                        "gbps": r["gbps"], "baseline_gbps": m["gbps"]})
    # Headline: the replica_num whose batch_get_into ratio is the lower one.
    head = min((x for x in sratios if x["op"] == "batch_get_into" and x["ratio"]),
               key=lambda x: x["ratio"], default=None)
    out = {"benchmark": "vs-mooncake", "quick": args.quick, "seconds": seconds,
           "rounds": rounds,
           "transfer": {"rows": rows, "raw_socket_rows": raw_rows,
                        "raw_socket_baseline": "each batch as one request of block x batch "
                        "bytes on one plain TCP connection, Python sendall/recv_into",
                        "ratios": ratios,
                        "min_ratio_64k_to_1m": min(small) if small else None,
                        "min_ratio_all": min((x["ratio"] for x in ratios if x["ratio"]),
                                             default=None)},
           "store": {"rows": srows, "ratios": sratios,
                     "min_ratio_all": min((x["ratio"] for x in sratios if x["ratio"]),
                                          default=None)},
           "headline": {"metric": "store batch_get_into GB/s, kvbridge / Mooncake (the lower of "
                        "replica_num 1 and 2)",
                        "value": head["gbps"] if head else None,
                        "baseline": head["baseline_gbps"] if head else None,
                        "baseline_name": "the real Mooncake (mooncake_master + 2 storage "
                        "processes) through the same Python API, same run",
                        "replica_num": head["replica_num"] if head else None,
                        "ratio": head["ratio"] if head else None, "goal": 1.5}}
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
