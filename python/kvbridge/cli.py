"""The ``kvbridge`` console command: master, node, status, bench.

    kvbridge master --listen 0.0.0.0:50051
    kvbridge node --master 10.0.0.1:50051 --dram-bytes 64G --listen 10.0.0.2:0
    kvbridge status --master 10.0.0.1:50051 [--json] [--watch [--interval S]]
    kvbridge bench [--master ADDR] [--pages 2048] [--page-kib 64] [--json]

Options not given as flags come from the KVBRIDGE_* variables, then the defaults
(docs/configuration.md). ``--json`` prints machine-readable lines instead of text; long work
shows a progress bar on stderr when it is a terminal (``--progress`` forces it).
Exit status: 0 success, 1 a kvbridge error (its name is printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1073741824', '512M', '64G', '1.5GiB' -> bytes (powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 64G)")
    scale = 1 << (10 * " KMGT".index(m.group(2).upper() or " "))
    return int(float(m.group(1)) * scale)


def _emit(args: argparse.Namespace, text: str, **fields: Any) -> None:
    if args.json:
        print(json.dumps(fields), flush=True)
    else:
        print(text, flush=True)


def _wait_for_signal(on_first: Optional[Callable[[], None]] = None) -> int:
    """Blocks until SIGINT/SIGTERM; returns the signal number."""
    got: list[int] = []
    event = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if got:  # a second signal: stop waiting for a graceful end
            os._exit(128 + signum)
        got.append(signum)
        event.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not event.wait(0.5):
        pass
    if on_first:
        on_first()
    return got[0]


def _metrics_listen(args: argparse.Namespace, default: str, kw: dict[str, Any]) -> None:
    """The daemons' HTTP endpoint: --metrics-listen, else KVBRIDGE_METRICS_LISTEN, else
    `default`, which may be busy (several nodes on one host): then a warning, no endpoint."""
    if args.metrics_listen is not None:
        kw["metrics_listen"] = "" if args.metrics_listen == "off" else args.metrics_listen
    elif "KVBRIDGE_METRICS_LISTEN" not in os.environ:
        kw["metrics_listen"] = default
        kw["metrics_listen_best_effort"] = True


def cmd_master(args: argparse.Namespace) -> int:
    import kvbridge

    kw = {k: v for k, v in (("master_listen", args.listen), ("node_ttl_ms", args.node_ttl_ms),
                           ("lease_ms", args.lease_ms), ("min_replicas", args.min_replicas))
          if v is not None}
    _metrics_listen(args, "0.0.0.0:9480", kw)
    master = kvbridge.Master(**kw)
    http = master.metrics_address
    _emit(args, f"kvbridge master listening on {master.address}"
          + (f", status page and /metrics on http://{http}" if http else "")
          + " (Ctrl-C or SIGTERM stops)",
          event="ready", role="master", address=master.address, metrics_address=http)
    _wait_for_signal()
    master.close()
    _emit(args, "kvbridge master stopped", event="stopped", role="master")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    import kvbridge

    kw: dict[str, Any] = {}
    for name, value in (("master", args.master), ("node_dram_bytes", args.dram_bytes),
                        ("listen", args.listen), ("node_id", args.node_id),
                        ("drain_timeout_ms", args.drain_timeout_ms),
                        ("node_ssd_path", args.ssd_path), ("node_ssd_bytes", args.ssd_bytes)):
        if value is not None:
            kw[name] = value
    _metrics_listen(args, "0.0.0.0:9481", kw)
    node = kvbridge.Node(**kw)
    node_id, inc = node.id
    ssd = node.ssd_status
    ssd_text = ("SSD tier at " + args.ssd_path if ssd.ok else
                "no SSD tier"
                + ("" if ssd.name == "NOT_FOUND" else f" ({ssd.name}: {ssd.message})"))
    _emit(args, f"kvbridge node {node_id} ({inc:#018x}) serving, {ssd_text}; SIGTERM drains, a "
          "second signal stops at once", event="ready", role="node", node_id=node_id,
          incarnation=inc, ssd=ssd.ok, ssd_error="" if ssd.ok else ssd.message,
          metrics_address=node.metrics_address)
    _wait_for_signal()
    _emit(args, f"draining {node.object_count} objects", event="draining",
          objects=node.object_count)
    status = "drained"
    try:
        node.drain()
    except kvbridge.KvbError as e:
        status = f"drain incomplete: {e}"
    node.close()
    _emit(args, f"kvbridge node {node_id} stopped ({status})", event="stopped", role="node",
          result=status)
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_status(args: argparse.Namespace) -> int:
    if args.interval is not None and not args.watch:
        build_parser().error("--interval goes with --watch")
    if not args.watch:
        return _print_status(args)
    interval = 2.0 if args.interval is None else args.interval
    if interval < 0.1:
        build_parser().error("--interval must be >= 0.1 seconds")
    from kvbridge.errors import KvbError

    tty = sys.stdout.isatty()
    try:
        while True:
            if tty:
                print("\033[H\033[2J", end="")
            if not args.json:
                print(f"every {interval:g}s, {time.strftime('%Y-%m-%d %H:%M:%S')} "
                      "(Ctrl-C to stop)")
            try:
                _print_status(args)
            except KvbError as e:  # said, and asked again
                print(f"kvbridge status: {e}", file=sys.stderr)
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _print_status(args: argparse.Namespace) -> int:
    import kvbridge

    st = kvbridge.cluster_status(args.master, args.timeout_ms)
    if args.json:
        print(json.dumps(st))
        return 0
    print(f"master {args.master}: {len(st['nodes'])} nodes, {st['objects']} objects "
          f"({_human(st['stored_bytes'])}), {st['pending_puts']} pending puts")
    print(f"{'NODE':<28} {'STATE':<9} {'CAPACITY':>11} {'USED':>11} {'USE%':>5} {'REPLICAS':>9}"
          f" {'SSD':>11} {'SSD USED':>11}")
    for n in st["nodes"]:
        pct = 100.0 * n["used_bytes"] / n["capacity_bytes"] if n["capacity_bytes"] else 0.0
        ssd = _human(n["ssd_capacity_bytes"]) if n["ssd_capacity_bytes"] else "-"
        ssd_used = _human(n["ssd_used_bytes"]) if n["ssd_capacity_bytes"] else "-"
        print(f"{n['node_id']:<28} {n['state']:<9} {_human(n['capacity_bytes']):>11} "
              f"{_human(n['used_bytes']):>11} {pct:>5.1f} {n['replicas']:>9} {ssd:>11} "
              f"{ssd_used:>11}")
    print(f"evictions {st['evictions_total']}, bad replicas dropped {st['bad_replicas_total']}, "
          f"reads that could not reach a node {st['unreachable_reports_total']}, "
          f"nodes expired {st['nodes_expired_total']}, under-replicated {st['under_replicated']}, "
          f"demoted to SSD {st['demotions_total']} ({st['ssd_replicas']} replicas on SSD), "
          f"copies remembered for nodes that left {st['departed_copies']}")
    return 0


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

    m = add("master", "run the store's master (control plane) until SIGINT/SIGTERM")
    m.add_argument("--listen", help="host:port to serve on (KVBRIDGE_MASTER_LISTEN)")
    m.add_argument("--node-ttl-ms", type=int, help="a node silent this long is dead")
    m.add_argument("--lease-ms", type=int, help="read lease granted to gets")
    m.add_argument("--min-replicas", type=int, help="replicas a put needs to count")
    m.add_argument("--metrics-listen", help="host:port of /metrics, /health and the status page, "
                   "or off (KVBRIDGE_METRICS_LISTEN; default 0.0.0.0:9480)")
    m.set_defaults(func=cmd_master)

    n = add("node", "run a storage node; SIGTERM drains it gracefully")
    n.add_argument("--master", help="the master's host:port (KVBRIDGE_MASTER)")
    n.add_argument("--dram-bytes", type=parse_size, help="DRAM to contribute, e.g. 64G")
    n.add_argument("--listen", help="transport listen addresses, host:port[,host:port...]")
    n.add_argument("--node-id", help="this node's id (default <hostname>-<pid>)")
    n.add_argument("--drain-timeout-ms", type=int, help="upper bound of the drain on SIGTERM")
    n.add_argument("--ssd-path", help="directory of this node's SSD tier (KVBRIDGE_NODE_SSD_PATH)")
    n.add_argument("--ssd-bytes", type=parse_size, help="capacity of the SSD tier, e.g. 500G")
    n.add_argument("--metrics-listen", help="host:port of /metrics and /health, or off "
                   "(KVBRIDGE_METRICS_LISTEN; default 0.0.0.0:9481)")
    n.set_defaults(func=cmd_node)

    s = add("status", "print a master's view of the cluster")
    s.add_argument("--master", default=os.environ.get("KVBRIDGE_MASTER", "127.0.0.1:50051"),
                   help="the master's host:port (default $KVBRIDGE_MASTER or 127.0.0.1:50051)")
    s.add_argument("--timeout-ms", type=int, default=3000)
    s.add_argument("--watch", action="store_true", help="redraw every --interval seconds")
    s.add_argument("--interval", type=float, help="seconds between refreshes (default 2)")
    s.set_defaults(func=cmd_status)

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
