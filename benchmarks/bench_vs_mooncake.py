"""kvbridge against the real Mooncake, same Python code, same run, loopback TCP.

    benchmarks/run vs-mooncake [--quick]

(a) transfer: batch_transfer_sync_write / _read between two processes (a server process per
    system registers a buffer; this process drives it through the Mooncake TransferEngine API:
    kvbridge.compat.mooncake.TransferEngine or mooncake.engine.TransferEngine), blocks of
    64 KiB .. 4 MiB, batches of `--batch` blocks, p50/p99 per batch; and, as the loopback
    limit of one synchronous stream, a raw-socket baseline moving each batch as ONE request
    over one plain TCP connection ("ratio_vs_raw_socket" for kvbridge,
    "gbps_mooncake_over_raw_socket" for Mooncake);
(b) store cells: mode x object size x op through MooncakeDistributedStore
    (kvbridge.compat.mooncake or mooncake.store), per iteration batch_put_from of fresh
    ~50-byte keys then batch_get_into of them, replica_num 1. Modes: remote = a master
    (kvbridge's, or Mooncake's mooncake_master) plus two storage processes per system, this
    process a pure client (global_segment_size 0); embedded = a master only, this process's
    setup contributes the only segment (as SGLang deploys Mooncake). Sizes (keys per batch):
    1 KiB (512), 16 KiB (128), 64 KiB (128), 1 MiB (16). Remote 64 KiB also runs replica_num 2.
    Objects/s and GB/s count the objects that succeeded; failures are counted per cell and
    round, and a cell with any is flagged. Headline: the minimum kvbridge/Mooncake objects/s
    ratio over the cells (named), goal 1.5.

--profile-cell MODE:SIZE:OP runs one store cell for one system in a loop (for perf or py-spy);
--py-spy OUT.svg records it with py-spy.

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

from benchlib import emit, free_port, gbps, parser, percentile, positive_int, ratio, rnd, wait_port


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
        # The daemon a deployment runs (`kvbridge master`, as Mooncake's side runs its
        # mooncake_master binary), not a Master inside a Python process: it runs on the
        # daemon's allocator (docs/performance.md "The daemons' allocator").
        p = subprocess.Popen([sys.executable, "-m", "kvbridge", "master", "--listen",
                              f"127.0.0.1:{free_port()}", "--lease-ms", "200",
                              "--metrics-listen", "off", "--json"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        ready = json.loads(p.stdout.readline())
        print(f"kvbridge master daemon on {ready['address']}, allocator "
              f"{ready.get('allocator', '?')}", file=sys.stderr)
        return ready["address"], p
    import mooncake
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    port = free_port()
    p = subprocess.Popen([binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                          f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1",
                          "--enable_metric_reporting=false", "--default_kv_lease_ttl=200"],
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, text=True)
    wait_port(port, 15, "mooncake_master")
    return f"127.0.0.1:{port}", p


def stop(p, grace: float = 20) -> None:
    """Closes the process's stdin (the storage processes serve until then) and waits `grace`
    seconds before SIGTERM; the masters read no stdin, so they get grace 0."""
    try:
        p.stdin.close()
    except Exception:  # noqa: BLE001
        pass
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()


# Store cells: object size -> keys per batch. 512 x 1 KiB and 128 x 16/64 KiB as an SGLang
# page batch; 16 x 1 MiB keeps a batch at 16 MiB.
KEYS_PER_BATCH = {1 << 10: 512, 16 << 10: 128, 64 << 10: 128, 1 << 20: 16}
MODES = ("remote", "embedded")
STORE_OPS = ("batch_put_from", "batch_get_into")
KEY_BYTES = 50  # like a page hash: 40 hex digits, "-", 9 hex digits (key_prefix)


def parse_size(text: str) -> int:
    """'1k', '16KiB', '1m', '65536' -> bytes; one of the cell sizes (KEYS_PER_BATCH)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) * mult not in KEYS_PER_BATCH:
        known = ", ".join(size_name(x) for x in KEYS_PER_BATCH)
        raise argparse.ArgumentTypeError(f"{text!r} is not a cell size (one of {known})")
    return int(digits) * mult


def size_list(text: str) -> list[int]:
    return sorted({parse_size(x) for x in text.split(",") if x.strip()})


def mode_list(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in MODES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{text!r}: modes are {', '.join(MODES)}")
    return [m for m in MODES if m in out]


def size_name(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 else f"{n >> 10}KiB"


def profile_cell(text: str) -> tuple[str, int, str]:
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in MODES or parts[2] not in STORE_OPS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not MODE:SIZE:OP (MODE {'|'.join(MODES)}, SIZE 1k|16k|64k|1m, "
            f"OP {'|'.join(STORE_OPS)})")
    return parts[0], parse_size(parts[1]), parts[2]


def store_cells(modes: list[str], sizes: list[int]) -> list[tuple[str, int, int]]:
    """(mode, object size, replica_num) of every store cell: replica_num 1 everywhere, plus
    replica_num 2 for remote 64 KiB (the figure the benchmark reported before it had cells)."""
    cells = []
    for mode in modes:
        for size in sizes:
            cells.append((mode, size, 1))
            if mode == "remote" and size == 64 << 10:
                cells.append((mode, size, 2))
    return cells


def key_prefix(*parts) -> str:
    """A hex digest of the cell's identity, so that every key is a fresh ~50-byte name."""
    import hashlib
    return hashlib.sha1("/".join(map(str, parts)).encode()).hexdigest()  # 40 hex digits


class StoreUnderTest:
    """One system's store in one mode, kept up across rounds and cell sizes so that the
    systems can be measured in turn. remote: a master, two storage processes of `segment`
    bytes each, and this process a pure client (global_segment_size 0). embedded: a master,
    and this process's setup contributes the only segment (`segment` bytes), as SGLang
    deploys Mooncake. The pool is emptied (remove_all) after each cell."""

    def __init__(self, impl: str, mode: str, segment: int, span: int):
        self.impl, self.mode, self.segment = impl, mode, segment
        self.master, self.mproc = start_master(impl)
        self.nodes = []
        try:
            for _ in range(2 if mode == "remote" else 0):
                n = subprocess.Popen([sys.executable, __file__, "--storage", impl,
                                      "--master-addr", self.master, "--bytes", str(segment)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
                self.nodes.append(n)
                line = n.stdout.readline().strip()
                if line != "ready":
                    raise RuntimeError(f"{impl} storage process: {line!r}")
            self.pool = segment * max(1, len(self.nodes))
            cls, self.config_cls = store_class(impl)
            self.client = cls()
            own = segment if mode == "embedded" else 0
            rc = self.client.setup("127.0.0.1", "P2PHANDSHAKE", own, 16 << 20, "tcp", "",
                                   self.master)
            if rc != 0:
                raise RuntimeError(f"{impl} {mode} client setup: {rc}")
            self.src_raw, self.src = aligned(span)
            self.dst_raw, self.dst = aligned(span)
            ctypes.memset(self.src, 0x3C, span)
            assert self.client.register_buffer(self.src, span) == 0
            assert self.client.register_buffer(self.dst, span) == 0
        except BaseException:
            self.close()
            raise

    def warm(self, size: int) -> float:
        """Fills the pool to the cells' limit with `size` objects once and empties it, untimed,
        so that every cell finds the segments' memory touched (steady state, as in a
        long-running engine) rather than charging first-touch page faults to whichever cell
        comes first. Seconds spent."""
        t0 = time.perf_counter()
        keys_n = KEYS_PER_BATCH[size]
        sizes = [size] * keys_n
        ptrs = [self.src + i * size for i in range(keys_n)]
        config = self.config_cls()
        prefix = key_prefix("warm", self.impl, self.mode, size)
        stored = 0
        for it in range(self.max_iters(size * keys_n, 1)):
            keys = [f"{prefix}-{it:05x}{i:04x}" for i in range(keys_n)]
            stored += sum(1 for r in self.client.batch_put_from(keys, ptrs, sizes, config)
                          if r == 0)
        if self.empty(stored) < stored:
            print(f"  WARNING {self.impl} {self.mode}: the pool was not emptied after the "
                  "warm-up fill", file=sys.stderr)
        return time.perf_counter() - t0

    def max_iters(self, batch_bytes: int, replicas: int) -> int:
        """Iterations that stay well inside the pool: no eviction in the measurement."""
        return max(1, int(0.7 * self.pool / (batch_bytes * replicas)))

    def empty(self, expected: int) -> int:
        """remove_all until the `expected` objects are gone (read leases expire after 200 ms);
        the objects removed, fewer than expected when the pool could not be emptied."""
        removed = 0
        for _ in range(20):
            time.sleep(0.3)  # past the read leases
            n = self.client.remove_all()
            removed += max(n, 0)
            if removed >= expected:
                break
        return removed

    def measure(self, size: int, replicas: int, seconds: float, rd: int) -> list[dict]:
        """Per iteration: batch_put_from of a batch of fresh keys, then batch_get_into of
        them, for `seconds`; one row per op. The pool is emptied after."""
        impl, keys_n = self.impl, KEYS_PER_BATCH[size]
        sizes = [size] * keys_n
        ptr_src = [self.src + i * size for i in range(keys_n)]
        ptr_dst = [self.dst + i * size for i in range(keys_n)]
        config = self.config_cls()
        config.replica_num = replicas
        prefix = key_prefix(impl, self.mode, size, replicas, rd)
        lat = {op: [] for op in STORE_OPS}
        ok = dict.fromkeys(STORE_OPS, 0)
        failed = dict.fromkeys(STORE_OPS, 0)
        max_iters = self.max_iters(size * keys_n, replicas)
        stored = 0
        it = -1  # iteration -1: a warm-up, not measured
        t_end = time.perf_counter() + seconds
        while it < max_iters and (it < 0 or time.perf_counter() < t_end):
            keys = [f"{prefix}-{it + 1:05x}{i:04x}" for i in range(keys_n)]
            t = time.perf_counter()
            res = self.client.batch_put_from(keys, ptr_src, sizes, config)
            dt_put = time.perf_counter() - t
            good_put = sum(1 for r in res if r == 0)
            stored += good_put
            t = time.perf_counter()
            got = self.client.batch_get_into(keys, ptr_dst, sizes)
            dt_get = time.perf_counter() - t
            good_get = sum(1 for r in got if r == size)
            if it >= 0:
                for op, dt, good in (("batch_put_from", dt_put, good_put),
                                     ("batch_get_into", dt_get, good_get)):
                    lat[op].append(dt)
                    ok[op] += good
                    failed[op] += keys_n - good
            it += 1
        removed = self.empty(stored)
        rows = []
        for op in STORE_OPS:
            rows.append(store_row({"system": impl, "mode": self.mode, "op": op,
                                   "object_bytes": size, "keys_per_batch": keys_n,
                                   "key_bytes": KEY_BYTES, "replica_num": replicas},
                                  size, lat[op], ok[op], failed[op]))
        if removed < stored:
            print(f"  WARNING {impl} {self.mode}: removed {removed} of {stored} objects after "
                  "the cell; the next cells run on a fuller pool", file=sys.stderr)
            for r in rows:
                r["not_emptied"] = stored - removed
        return rows

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
        for n in self.nodes:
            stop(n)
        stop(self.mproc, grace=0)  # both masters stop on SIGTERM; neither reads stdin


def store_row(fields: dict, obj_bytes: int, lat: list[float], ok: int, failed: int) -> dict:
    """One store cell's op in one round. Rates count the objects that succeeded over the
    time spent in the calls; `failures` the objects that did not."""
    total = sum(lat)
    r = {**fields, "objs_per_s": rnd(ok / total if total > 0 else 0.0, 1),
         "gbps": rnd(gbps(ok * obj_bytes, total)),
         "p50_ms": ms(percentile(lat, 50)), "p99_ms": ms(percentile(lat, 99)),
         "batches": len(lat), "failures": failed,
         "_lat": lat, "_ok": ok, "_total": total}
    flag = f", {failed} FAILED" if failed else ""
    print(f"  {fields['system'][:8]:8s} {fields['mode']:8s} {fields['op']:15s} "
          f"{size_name(obj_bytes):>6s} x{fields['keys_per_batch']:<4d} r{fields['replica_num']}: "
          f"{r['objs_per_s']:10.1f} obj/s {r['gbps']:7.3f} GB/s p50 {r['p50_ms']} ms "
          f"p99 {r['p99_ms']} ms{flag}", file=sys.stderr)
    return r


def merge_store_rounds(rows: list[dict]) -> list[dict]:
    """Pools a cell's rounds: rates over the summed call time, percentiles over every batch;
    the failures of each round stay listed (failures_per_round)."""
    measured = {"objs_per_s", "gbps", "p50_ms", "p99_ms", "batches", "failures", "_lat",
                "_ok", "_total", "not_emptied"}
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = tuple(sorted((k, v) for k, v in r.items() if k not in measured))
        m = merged.setdefault(key, {k: v for k, v in r.items() if k not in measured}
                              | {"_lat": [], "_ok": 0, "_total": 0.0,
                                 "failures_per_round": [], "not_emptied": 0})
        m["_lat"] += r["_lat"]
        m["_ok"] += r["_ok"]
        m["_total"] += r["_total"]
        m["failures_per_round"].append(r["failures"])
        m["not_emptied"] += r.get("not_emptied", 0)
    out = []
    for m in merged.values():
        lat, ok, total = m.pop("_lat"), m.pop("_ok"), m.pop("_total")
        m.update(objs_per_s=rnd(ok / total if total > 0 else 0.0, 1),
                 gbps=rnd(gbps(ok * m["object_bytes"], total)),
                 p50_ms=ms(percentile(lat, 50)), p99_ms=ms(percentile(lat, 99)),
                 batches=len(lat), failures=sum(m["failures_per_round"]),
                 rounds=len(m["failures_per_round"]))
        if not m["not_emptied"]:
            del m["not_emptied"]
        out.append(m)
    return out


def cell_name(r: dict) -> str:
    return f"{r['mode']}:{size_name(r['object_bytes'])}:{r['op']}:r{r['replica_num']}"


def bench_store(modes: list[str], sizes: list[int], seconds: float, rounds: int,
                segment: int) -> list[dict]:
    """Every store cell of `modes` x `sizes`, each system's cluster started once per mode and
    kept across sizes and rounds; the systems take turns per cell, the order flipped each
    round."""
    cells = store_cells(modes, sizes)
    span = max(s * KEYS_PER_BATCH[s] for s in sizes)
    rows = []
    for mode in modes:
        print(f"store, {mode} mode: " + ("master + 2 storage processes per system, this "
              "process a pure client" if mode == "remote" else "a master per system, this "
              "process's setup contributes the only segment"), file=sys.stderr)
        stores = []
        try:
            for impl in ("kvbridge", "mooncake"):
                stores.append(StoreUnderTest(impl, mode, segment, span))
            for st in stores:
                took = st.warm(max(sizes))
                print(f"  {st.impl} {mode}: pool warmed (filled once, emptied) in {took:.1f} s",
                      file=sys.stderr)
            for rd in range(rounds):
                print(f" round {rd + 1} of {rounds}", file=sys.stderr)
                order = stores if rd % 2 == 0 else stores[::-1]
                for m, size, replicas in cells:
                    if m != mode:
                        continue
                    for st in order:
                        rows += st.measure(size, replicas, seconds / rounds, rd)
        finally:
            for st in stores:
                st.close()
    return merge_store_rounds(rows)


def store_ratios(srows: list[dict]) -> list[dict]:
    """kvbridge / Mooncake per cell, objects/s; a cell where either system failed an object is
    flagged (`failed`) and named in the headline."""
    out = []
    for r in srows:
        if r["system"] != "kvbridge":
            continue
        m = next((x for x in srows if x["system"] == "mooncake" and cell_name(x) == cell_name(r)),
                 None)
        if m is None:
            continue
        out.append({"cell": cell_name(r), "mode": r["mode"], "object_bytes": r["object_bytes"],
                    "keys_per_batch": r["keys_per_batch"], "op": r["op"],
                    "replica_num": r["replica_num"],
                    "ratio": ratio(r["objs_per_s"], m["objs_per_s"]),
                    "objs_per_s": r["objs_per_s"], "baseline_objs_per_s": m["objs_per_s"],
                    "gbps": r["gbps"], "baseline_gbps": m["gbps"],
                    "p99_kvbridge_over_mooncake": ratio(r["p99_ms"], m["p99_ms"]),
                    "failures": r["failures"], "baseline_failures": m["failures"],
                    "failed": bool(r["failures"] or m["failures"])})
    return out


def profile(mode: str, size: int, op: str, impl: str, seconds: float, segment: int,
            py_spy: str | None) -> dict:
    """One store cell for one system in a loop for `seconds` (perf record -p / py-spy can be
    attached to the pid printed first), obj/s on stderr every second. batch_get_into reads one
    batch stored before the loop; batch_put_from puts fresh keys, emptying the pool (untimed)
    before it fills."""
    keys_n = KEYS_PER_BATCH[size]
    st = StoreUnderTest(impl, mode, segment, size * keys_n)
    spy = None
    try:
        st.warm(size)
        sizes = [size] * keys_n
        ptr_src = [st.src + i * size for i in range(keys_n)]
        ptr_dst = [st.dst + i * size for i in range(keys_n)]
        config = st.config_cls()
        prefix = key_prefix("profile", impl, mode, size, os.getpid())
        keys = [f"{prefix}-00000{i:04x}" for i in range(keys_n)]
        assert all(r == 0 for r in st.client.batch_put_from(keys, ptr_src, sizes, config))
        max_iters = st.max_iters(size * keys_n, 1)
        print(f"profile: pid {os.getpid()}, {impl} {mode}:{size_name(size)}:{op} "
              f"({keys_n} keys per batch) for {seconds} s", file=sys.stderr)
        if py_spy:
            spy = start_py_spy(py_spy)
        ok = failed = 0
        busy = 0.0
        it = stored = 1
        t0 = tick = time.perf_counter()
        n_tick = 0
        emptied = False  # this second included an (untimed) remove_all
        while True:
            now = time.perf_counter()
            if now - tick >= 1.0:
                note = "  (the pool was emptied in this second)" if emptied else ""
                print(f"  {n_tick / (now - tick):10.1f} obj/s{note}", file=sys.stderr)
                tick, n_tick, emptied = now, 0, False
            if now - t0 >= seconds:
                break
            if op == "batch_get_into":
                t = time.perf_counter()
                got = st.client.batch_get_into(keys, ptr_dst, sizes)
                busy += time.perf_counter() - t
                good = sum(1 for r in got if r == size)
            else:
                if stored >= max_iters:
                    st.client.remove_all()
                    stored, emptied = 0, True
                ks = [f"{prefix}-{it % 0x100000:05x}{i:04x}" for i in range(keys_n)]
                t = time.perf_counter()
                res = st.client.batch_put_from(ks, ptr_src, sizes, config)
                busy += time.perf_counter() - t
                good = sum(1 for r in res if r == 0)
                it += 1
                stored += 1
            ok += good
            n_tick += good
            failed += keys_n - good
    finally:
        if spy is not None:
            stop_py_spy(spy)
        st.close()
    return {"cell": f"{mode}:{size_name(size)}:{op}:r1", "system": impl,
            "keys_per_batch": keys_n, "seconds": seconds,
            "objs_per_s": rnd(ok / busy if busy > 0 else 0.0, 1),
            "gbps": rnd(gbps(ok * size, busy)), "failures": failed,
            "py_spy": py_spy}


def py_spy_binary() -> str | None:
    import shutil
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def start_py_spy(out: str):
    """py-spy recording this process (Python and native frames of the threads that run Python)
    into `out`: a flame graph (.svg), collapsed stacks (.txt) or speedscope JSON (.json)."""
    binary = py_spy_binary()
    if binary is None:
        raise RuntimeError("--py-spy: no py-spy (scripts/setup_mooncake_venv.sh installs it "
                           "into .venv-mooncake)")
    fmt = {".txt": "raw", ".json": "speedscope"}.get(os.path.splitext(out)[1], "flamegraph")
    # --idle keeps the samples where the thread waits (on the RPC, a lock): without it the
    # waiting would drop out of the percentages.
    p = subprocess.Popen([binary, "record", "--native", "--idle", "--format", fmt,
                          "--output", out, "--pid", str(os.getpid())],
                         stdout=sys.stderr, stderr=sys.stderr)
    time.sleep(1.0)  # attached before the loop starts
    if p.poll() is not None:
        raise RuntimeError(f"py-spy exited at once ({p.returncode}); see above")
    return p


def stop_py_spy(p) -> None:
    import signal
    p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()


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
    ap = parser(__doc__, quick="transfers 0.5 s per phase, store cells 1 s each, 1 round "
                "(unless given): 1-2 minutes",
                seconds="seconds per phase (a transfer size and op, or a store cell), over all "
                "rounds (default 3; --quick 0.5 per transfer phase, 1 per store cell; with "
                "--profile-cell the loop's length, default 20)",
                rounds="alternate the systems this many times, each phase getting "
                "seconds/rounds, and pool the rounds (default 3, --quick 1), so that load "
                "drifting on the machine weighs on every system alike")
    ap.add_argument("--batch", type=positive_int, default=16, help="blocks per transfer batch")
    ap.add_argument("--segment-mib", type=positive_int, default=1024,
                    help="bytes each segment contributes (MiB): each storage process in remote "
                    "mode, the client in embedded mode")
    ap.add_argument("--only", choices=("transfer", "store"),
                    help="run one part only (the headline needs the store part)")
    ap.add_argument("--sizes", type=size_list, default=sorted(KEYS_PER_BATCH),
                    help="store cells' object sizes, of 1k,16k,64k,1m (default all); keys per "
                    "batch: 512 x 1 KiB, 128 x 16 KiB, 128 x 64 KiB, 16 x 1 MiB")
    ap.add_argument("--modes", type=mode_list, default=list(MODES),
                    help="store cells' modes, of remote,embedded (default both): remote = master "
                    "+ 2 storage processes, this process a pure client; embedded = a master, "
                    "this process's setup contributes the only segment")
    ap.add_argument("--profile-cell", type=profile_cell, metavar="MODE:SIZE:OP",
                    help="run only this store cell (e.g. embedded:1k:batch_get_into) for one "
                    "system in a loop for --seconds, printing the pid first and obj/s every "
                    "second on stderr, for perf record -p PID or py-spy")
    ap.add_argument("--profile-system", choices=("kvbridge", "mooncake"), default="kvbridge",
                    help="the system --profile-cell runs (default kvbridge)")
    ap.add_argument("--py-spy", metavar="OUT.svg",
                    help="with --profile-cell: record the loop with py-spy (--native) into OUT: "
                    "a flame graph (.svg), collapsed stacks (.txt) or speedscope JSON (.json)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
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
    if args.storage:
        serve_storage(args.storage, args.master_addr, args.bytes)
        return 0
    if args.py_spy and not args.profile_cell:
        ap.error("--py-spy needs --profile-cell")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        print(json.dumps({"benchmark": "vs-mooncake", "error": f"Mooncake not importable: {e}; "
                          "run scripts/setup_mooncake_venv.sh"}))
        return 1
    if args.profile_cell:
        mode, size, op = args.profile_cell
        res = profile(mode, size, op, args.profile_system, args.seconds or 20.0,
                      args.segment_mib << 20, args.py_spy)
        emit({"benchmark": "vs-mooncake", "profile": res})
        return 0
    seconds = args.seconds or (0.5 if args.quick else 3.0)
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
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
    srows = []
    store_seconds = args.seconds or (1.0 if args.quick else 3.0)
    if args.only != "transfer":
        srows = bench_store(args.modes, args.sizes, store_seconds, rounds,
                            args.segment_mib << 20)
    sratios = store_ratios(srows)
    for x in sratios:
        print(f"  {x['cell']:36s} kvbridge/Mooncake obj/s {x['ratio']}"
              + ("  FAILURES" if x["failed"] else ""), file=sys.stderr)
    rated = [x for x in sratios if x["ratio"] is not None]
    head = min(rated, key=lambda x: x["ratio"], default=None)
    per_mode = {}
    for mode in args.modes:
        low = min((x for x in rated if x["mode"] == mode), key=lambda x: x["ratio"], default=None)
        per_mode[mode] = {"cell": low["cell"], "ratio": low["ratio"]} if low else None
    # The figure the benchmark headlined before it had cells: remote 64 KiB batch_get_into
    # GB/s, the lower of replica_num 1 and 2.
    old = min((x for x in sratios if x["mode"] == "remote" and x["object_bytes"] == 64 << 10
               and x["op"] == "batch_get_into" and x["ratio"] is not None),
              key=lambda x: x["ratio"], default=None)
    flagged = [x["cell"] for x in sratios if x["failed"]]
    out = {"benchmark": "vs-mooncake", "quick": args.quick, "seconds": seconds,
           "rounds": rounds,
           "transfer": {"rows": rows, "raw_socket_rows": raw_rows,
                        "raw_socket_baseline": "each batch as one request of block x batch "
                        "bytes on one plain TCP connection, Python sendall/recv_into",
                        "ratios": ratios,
                        "min_ratio_64k_to_1m": min(small) if small else None,
                        "min_ratio_all": min((x["ratio"] for x in ratios if x["ratio"]),
                                             default=None)},
           "store": {"seconds_per_cell": store_seconds if srows else None,
                     "modes": args.modes, "object_bytes": args.sizes,
                     "keys_per_batch": {str(k): v for k, v in KEYS_PER_BATCH.items()
                                        if k in args.sizes},
                     "key_bytes": KEY_BYTES, "segment_bytes": args.segment_mib << 20,
                     "rows": srows, "ratios": sratios,
                     "min_ratio_per_mode": per_mode,
                     "cells_with_failures": flagged,
                     "remote_64k_get_gbps_ratio_min_r1_r2":
                         ratio(old["gbps"], old["baseline_gbps"]) if old else None},
           "headline": {"metric": "store objects/s, kvbridge / Mooncake, the minimum over every "
                        "store cell (mode x object size x op, replica_num 1; remote 64 KiB "
                        "also replica_num 2)",
                        "cell": head["cell"] if head else None,
                        "value": head["objs_per_s"] if head else None,
                        "baseline": head["baseline_objs_per_s"] if head else None,
                        "baseline_name": "the real Mooncake (mooncake_master, plus 2 storage "
                        "processes in remote mode) through the same Python API, same run",
                        "ratio": head["ratio"] if head else None, "goal": 1.5,
                        "min_ratio_per_mode": {k: v["ratio"] if v else None
                                               for k, v in per_mode.items()},
                        "cells_with_failures": flagged}}
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
