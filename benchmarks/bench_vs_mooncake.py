"""kvbridge against the real Mooncake, same Python code, same run, loopback TCP.

    benchmarks/run vs-mooncake [--quick]

(a) transfer: batch_transfer_sync_write / _read between two processes (a server process per
    system registers a buffer; this process drives it through the Mooncake TransferEngine API:
    kvbridge.compat.mooncake.TransferEngine or mooncake.engine.TransferEngine), blocks of
    64 KiB .. 4 MiB, batches of `--batch` blocks, p50/p99 per batch;
(b) store: (see --store) batch_put_from / batch_get_into of 128 x 64 KiB pages through
    MooncakeDistributedStore, replica_num 1 and 2, when the store compat layer is present.

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


def percentile(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


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
                fn = eng.batch_transfer_sync_write if op == "write" else eng.batch_transfer_sync_read
                assert fn(session, locs, rems, lens) == 0  # warm-up (connections, handshake)
                lat, failed = [], 0
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    t = time.perf_counter()
                    failed += fn(session, locs, rems, lens) != 0
                    lat.append(time.perf_counter() - t)
                total = time.perf_counter() - t0
                rows.append({"system": impl, "op": op, "block_bytes": size, "batch": batch,
                             "gbps": round(size * batch * len(lat) / total / 1e9, 3),
                             "p50_ms": round(percentile(lat, 0.5) * 1e3, 3),
                             "p99_ms": round(percentile(lat, 0.99) * 1e3, 3),
                             "batches": len(lat), "failed": failed})
                print(f"  {impl:8s} {op:5s} {size >> 10:5d} KiB: {rows[-1]['gbps']:7.3f} GB/s "
                      f"p50 {rows[-1]['p50_ms']:.3f} ms p99 {rows[-1]['p99_ms']:.3f} ms",
                      file=sys.stderr)
    finally:
        server.stdin.close()
        server.wait(timeout=10)
        if hasattr(eng, "close"):
            eng.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.bytes)
        return 0
    seconds = args.seconds or (0.5 if args.quick else 3.0)
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        print(json.dumps({"benchmark": "vs-mooncake", "error": f"Mooncake not importable: {e}; "
                          "run scripts/setup_mooncake_venv.sh"}))
        return 1
    print("transfer: batch_transfer_sync_write/read, two processes, loopback TCP",
          file=sys.stderr)
    rows = []
    for impl in ("kvbridge", "mooncake"):
        rows += bench_transfer(impl, sizes, args.batch, seconds)
    ratios = []
    for r in rows:
        if r["system"] != "kvbridge":
            continue
        m = next(x for x in rows if x["system"] == "mooncake" and x["op"] == r["op"]
                 and x["block_bytes"] == r["block_bytes"])
        ratios.append({"op": r["op"], "block_bytes": r["block_bytes"],
                       "ratio": round(r["gbps"] / m["gbps"], 3) if m["gbps"] else None,
                       "p99_ratio": round(r["p99_ms"] / m["p99_ms"], 3) if m["p99_ms"] else None})
    small = [x["ratio"] for x in ratios if x["block_bytes"] <= (1 << 20) and x["ratio"]]
    out = {"benchmark": "vs-mooncake", "quick": args.quick, "seconds": seconds,
           "transfer": {"rows": rows, "ratios": ratios,
                        "min_ratio_64k_to_1m": min(small) if small else None,
                        "min_ratio_all": min(x["ratio"] for x in ratios if x["ratio"])},
           "store": None,
           "headline": {"metric": "transfer GB/s kvbridge / Mooncake, minimum over "
                        "64 KiB-1 MiB write and read (the store headline arrives with the "
                        "store part)", "value": min(small) if small else None,
                        "goal": 1.5}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
