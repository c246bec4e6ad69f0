"""The ``kvbridge`` console command: master, node, status (the C++ daemon), bench.

    kvbridge master --listen 0.0.0.0:50051
    kvbridge node --master 10.0.0.1:50051 --dram-bytes 64G --listen 10.0.0.2:0
    kvbridge status --master 10.0.0.1:50051 [--json] [--watch [--interval S]]
    kvbridge bench [--master ADDR] [--pages 2048] [--page-kib 64] [--json]

``master``, ``node`` and ``status`` replace this process with the daemon program shipped in
the package (``kvbridge/bin/kvbridge``; in a build tree ``build/bin/kvbridge``), given the same
arguments: its flags, ``--config``, ``--json``, signals and exit status are this command's
(``kvbridge master --help`` lists the flags). Options not given as flags come from the
KVBRIDGE_* variables, then the defaults (docs/configuration.md). ``--json`` prints
machine-readable lines instead of text; long work shows a progress bar on stderr when it is a
terminal (``--progress`` forces it).
Exit status: 0 success, 1 a kvbridge error (its name is printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

# The commands the daemon program runs (csrc/tools/kvbridge_main.cc).
DAEMON_COMMANDS = ("master", "node", "status")


def daemon_path() -> str:
    """The daemon program: the package's bin/kvbridge (an installed wheel), else the build
    tree's bin/kvbridge (PYTHONPATH=build/python, where this package is build/python/kvbridge).
    FileNotFoundError naming the places looked at when there is none."""
    pkg = os.path.dirname(os.path.abspath(__file__))  # not resolved: the build tree's links
    candidates = [os.path.join(pkg, "bin", "kvbridge"),
                  os.path.join(os.path.dirname(os.path.dirname(pkg)), "bin", "kvbridge")]
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "the kvbridge daemon program is missing: none of " + ", ".join(candidates) + " is an "
        "executable file (a wheel ships it as kvbridge/bin/kvbridge; in a build tree, build the "
        "kvbridge_cli target)")


def exec_daemon(argv: Sequence[str]) -> int:
    """Replaces this process with the daemon running `argv` (a command and its flags)."""
    try:
        path = daemon_path()
    except FileNotFoundError as e:
        print(f"kvbridge {argv[0]}: {e}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [path, *argv])
    return 1  # not reached


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def cmd_bench(args: argparse.Namespace) -> int:
    """Batch put then batch get of --pages pages through a store (an embedded cluster unless
    --master is given), timed per batch."""
    import kvbridge
    from kvbridge._progress import Progress

    page = args.page_kib * 1024
    cluster = None
    if args.master:
        client = kvbridge.StoreClient(master=args.master, replica_num=args.replica_num)
    else:
        need = page * args.pages * args.replica_num
        per_node = max(64 << 20, int(need / args.nodes / 0.7) + (16 << 20))
        cluster = kvbridge.Cluster(nodes=args.nodes, replica_num=args.replica_num,
                                   dram_bytes_per_node=per_node)
        client = cluster.client()
    try:
        src = bytearray(os.urandom(page)) * args.batch
        dst = bytearray(page * args.batch)
        client.register_buffer(src)
        client.register_buffer(dst)
        src_mv, dst_mv = memoryview(src), memoryview(dst)
        bufs_in = [src_mv[i * page:(i + 1) * page] for i in range(args.batch)]
        bufs_out = [dst_mv[i * page:(i + 1) * page] for i in range(args.batch)]
        prefix = f"kvbridge-bench-{os.getpid()}-{time.monotonic_ns()}"
        keys = [f"{prefix}/{i}" for i in range(args.pages)]
        results: dict[str, Any] = {}
        for phase in ("put", "get"):
            lat: list[float] = []
            failed = 0
            t0 = time.perf_counter()
            with Progress(args.pages, phase, "pages", enabled=args.progress) as bar:
                for start in range(0, args.pages, args.batch):
                    chunk = keys[start:start + args.batch]
                    t = time.perf_counter()
                    if phase == "put":
                        st = client.batch_put_from(chunk, bufs_in[:len(chunk)])
                        failed += sum(1 for s in st if not s.ok)
                    else:
                        rs = client.batch_get_into(chunk, bufs_out[:len(chunk)])
                        failed += sum(1 for r in rs if not r.ok)
                    lat.append(time.perf_counter() - t)
                    bar.update(len(chunk))
            secs = time.perf_counter() - t0
            results[phase] = {
                "gbps": round(page * args.pages / secs / 1e9, 3),
                "pages_per_s": round(args.pages / secs, 1),
                "batch_p50_ms": round(_percentile(lat, 0.5) * 1e3, 3),
                "batch_p99_ms": round(_percentile(lat, 0.99) * 1e3, 3),
                "failed": failed,
            }
        if dst_mv[:page] != src_mv[:page]:
            results["get"]["failed"] = max(results["get"]["failed"], 1)
            results["content_mismatch"] = True
        client.batch_remove(keys)
    finally:
        if cluster is not None:
            cluster.close()
        else:
            client.close()
    out = {"name": "kvbridge-cli-bench", "config": {
        "pages": args.pages, "page_kib": args.page_kib, "batch": args.batch,
        "replica_num": args.replica_num,
        "cluster": args.master or f"embedded, {args.nodes} nodes"}, **results}
    if args.json:
        print(json.dumps(out))
    else:
        for phase in ("put", "get"):
            r = results[phase]
            print(f"{phase}: {r['gbps']:.3f} GB/s, {r['pages_per_s']:.0f} pages/s, batch p50 "
                  f"{r['batch_p50_ms']:.2f} ms, p99 {r['batch_p99_ms']:.2f} ms, "
                  f"{r['failed']} failed")
    return 0 if results["put"]["failed"] == 0 and results["get"]["failed"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbridge", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    for name, text in (("master", "run the store's master (control plane)"),
                       ("node", "run a storage node; SIGTERM drains it"),
                       ("status", "print a master's view of the cluster")):
        sub.add_parser(name, help=f"{text} (`kvbridge {name} --help` lists its flags)",
                       add_help=False)

    b = add("bench", "time batch puts and gets of KV pages (embedded cluster by default)")
    b.add_argument("--master", help="bench an existing cluster instead of an embedded one")
    b.add_argument("--nodes", type=int, default=2, help="embedded cluster size")
    b.add_argument("--pages", type=int, default=2048)
    b.add_argument("--page-kib", type=int, default=64)
    b.add_argument("--batch", type=int, default=128)
    b.add_argument("--replica-num", type=int, default=1)
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DAEMON_COMMANDS:
        return exec_daemon(argv)
    args = build_parser().parse_args(argv)
    for name in ("pages", "page_kib", "batch", "replica_num", "nodes"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            build_parser().error(f"--{name.replace('_', '-')} must be >= 1")
    from kvbridge.errors import KvbError

    try:
        return args.func(args)
    except KvbError as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": e.name, "code": e.code, "message": e.message}))
        print(f"kvbridge {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
