#!/usr/bin/env python3
"""benchmarks/run ucx: kvbridge over UCX vs. ucx_perftest and vs. kvbridge's tcp plugin.

One run measures, for each UCX_TLS set ("sm": sysv,posix,cma,self with same-host NONE-mode
endpoints; "tcp": tcp with PEER-mode endpoints, ucx.same_host=off) and each block size:
  - ucx_perftest (ucp_put_bw for writes, ucp_get for reads) as a server/client pair on
    127.0.0.1 with that UCX_TLS;
  - kvb_bench_transfer --transport ucx with ucx.tls set to the same list (1 thread, batches of
    16 ops), writes and reads;
  - kvb_bench_transfer --transport tcp at the same sizes and shape;
  - kvb_bench_ucp: plain UCP, the same batches and window as kvbridge, a put batch ending with
    an endpoint flush (remote completion, what a kvbridge WRITE waits for; ucx_perftest's
    ucp_put_bw flushes once at the end), one block as perftest;
  - memcpy of the same block in this process (the ceiling for a same-host copy).
--ucx picks the UCX on both sides: "pypi" (the default when the build has
build/plugins_ucx_pypi) is PyPI's libucx-cu13 (UCX 1.22: the plugin built on it, selected with
KVBRIDGE_PLUGIN_PATH, and that wheel's own ucx_perftest); "system" is Debian's UCX 1.13 (the
build's plugins/ and /usr/bin/ucx_perftest).
Per op and block, kvbridge and ucx_perftest run back to back; --rounds N repeats that, alternating
which goes first, and a cell reports the medians of its rounds.
Progress goes to stderr; the last stdout line is one JSON object. Goals are reported, never
asserted: the exit status is non-zero only when a measurement could not be taken.
"""
import json
import os
import subprocess
import sys
import time

from benchlib import emit, free_port, gbps, int_list, median, parser, ratio, rnd

# perftest_flags: the endpoint error mode kvbridge uses for that set, given to ucx_perftest too
# ("-e": UCP_ERR_HANDLING_MODE_PEER, which kvbridge needs to notice a dead remote peer; with it
# UCX 1.22's tcp PUT waits for the target's acknowledgement, a quarter of the no-error-handling
# rate). Same-host endpoints use NONE mode (docs/transports/ucx.md) and so does perftest there.
TLS_SETS = {
    "sm": {"tls": "sysv,posix,cma,self", "same_host": "auto", "perftest_flags": []},
    "tcp": {"tls": "tcp,self", "same_host": "off", "perftest_flags": ["-e"]},
}
MIB = 1 << 20


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def ucx_choice(name, build):
    """(perftest binary, its extra env, kvb_bench_transfer's extra env, UCX version) for --ucx."""
    if name == "system":
        out = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True).stdout
        # "# Version 1.13.1" (1.13) or "# Library version: 1.22.0" (newer)
        version = next((ln.split()[-1] for ln in out.splitlines()
                        if ln.startswith("# Version") or "Library version" in ln), "?")
        return "ucx_perftest", {}, {}, version
    import libucx  # PyPI's libucx-cu13 (python/requirements-dev.txt)
    root = os.path.dirname(libucx.__file__)
    plugins = os.path.abspath(os.path.join(build, "plugins_ucx_pypi"))
    if not os.path.exists(os.path.join(plugins, "libkvb_transport_ucx.so")):
        raise RuntimeError(f"--ucx pypi: {plugins} has no ucx plugin (build with the project venv)")
    with open(os.path.join(root, "UCX_WHEEL_VERSION.txt")) as f:
        version = f.read().strip()
    lib_env = {"LD_LIBRARY_PATH": os.path.join(root, "lib")}
    perftest_bin = os.path.join(root, "bin", "ucx_perftest")
    return perftest_bin, lib_env, {"KVBRIDGE_PLUGIN_PATH": plugins}, version


def ucp_binary(name, build):
    """kvb_bench_ucp built on the UCX that --ucx names, or None when the build has none."""
    path = os.path.join(build, "benchmarks", "kvb_bench_ucp" + ("_pypi" if name == "pypi" else ""))
    return path if os.access(path, os.X_OK) else None


def ucp_op(binary, extra_env, op, block, seconds, window, tls):
    """GB/s of plain UCP batches (kvb_bench_ucp) for one op at one block size; None without it."""
    if binary is None:
        return None
    log(f"ucx bench: plain UCP {op} {block} B, UCX_TLS={tls['tls']} ...")
    cmd = [binary, "--op", op, "--block", str(block), "--batch", "16", "--window", str(window),
           "--seconds", str(seconds)] + (["--peer-mode"] if "-e" in tls["perftest_flags"] else [])
    env = dict(os.environ, UCX_TLS=tls["tls"], **extra_env)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["gbps"]


def perftest(binary, extra_env, test, size, iters, tls, flags):
    """GB/s (1e9 bytes/s) from ucx_perftest's "Final:" row (its bandwidth column is MiB/s)."""
    env = dict(os.environ, UCX_TLS=tls, **extra_env)
    port = free_port()
    server = subprocess.Popen([binary, "-p", str(port)] + flags, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(
            [binary, "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size), "-n",
             str(iters), "-w", str(max(10, iters // 10))] + flags,
            env=env, capture_output=True, text=True, timeout=120).stdout
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    for line in out.splitlines():
        if line.startswith("Final:"):
            cols = line.split()
            return float(cols[5]) * MIB / 1e9  # "average" bandwidth, MiB/s
    raise RuntimeError(f"ucx_perftest {test} {size} printed no Final row:\n{out}")


# What kvb_bench_transfer is told per --shape. "perftest" moves what ucx_perftest moves: one
# block, hot, in huge-page-backed memory (perftest's buffers come from ucp_mem_map's allocator,
# which asks for transparent huge pages). "walk": 16 distinct blocks per batch in plain heap
# memory (4 KiB pages), the footprint of a batch of KV pages.
SHAPES = {
    "perftest": ["--same-block", "--memory", "thp"],
    "walk": ["--memory", "plain"],
}


def kvb_bench(build, transport, blocks, seconds, config, shape, window, extra_env=None,
              ops="write,read"):
    cmd = [os.path.join(build, "benchmarks", "kvb_bench_transfer"), "--transport", transport,
           "--ops", ops,
           "--threads", "1", "--batch", "16", "--window", str(window),
           "--seconds", str(seconds), "--no-raw",
           "--no-latency", "--region", str(max(64 * MIB, 16 * max(blocks) * 2)),
           "--blocks", ",".join(str(b) for b in blocks)] + SHAPES[shape]
    for kv in config:
        cmd += ["--config", kv]
    env = dict(os.environ, **(extra_env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for row in res["results"]:
        out[(row["op"], row["block_bytes"])] = (row["gbps"], row["failures"])
    return out


def memcpy_gbps(size, seconds=0.3):
    src = bytearray(os.urandom(size))
    dst = bytearray(size)
    mv_src, mv_dst = memoryview(src), memoryview(dst)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        mv_dst[:] = mv_src
        n += 1
    return gbps(n * size, time.perf_counter() - t0)


def kvb_ucx(set_name, tls, op, block, kvb_args):
    """(GB/s, failures) of kvbridge over ucx for one op at one block size."""
    log(f"ucx bench: kvbridge ucx {op} {block} B, set {set_name} (ucx.tls={tls['tls']}) ...")
    return kvb_bench(*kvb_args, ops=op)[(op, block)]


def perftest_op(binary, extra_env, test, block, iters, tls):
    """GB/s of ucx_perftest's `test` at one block size."""
    log(f"ucx bench: ucx_perftest {test} {block} B, UCX_TLS={tls['tls']} ...")
    return perftest(binary, extra_env, test, block, iters, tls["tls"], tls["perftest_flags"])


def median_ratio(pairs):
    """The median of value/baseline over (value, baseline) pairs with a baseline."""
    return median(q for q in (ratio(v, b) for v, b in pairs) if q is not None)


def main():
    ap = parser(__doc__, quick="64 KiB and 1 MiB, 1 s each (unless given)",
                seconds="seconds per point (default 2)",
                rounds="measurements of each block (default 1): per round kvbridge and "
                       "ucx_perftest run back to back, their order alternating; a cell reports "
                       "the median of its rounds")
    ap.add_argument("--blocks", type=int_list, default=None,
                    help="block sizes in bytes (default 65536,262144,1048576,4194304)")
    ap.add_argument("--sets", default="sm,tcp", help="UCX_TLS sets: sm, tcp or both")
    ap.add_argument("--build", default=os.environ.get("BUILD_DIR", "build"))
    ap.add_argument("--shape", choices=tuple(SHAPES), default="perftest",
                    help="what kvbridge moves: perftest (the default: one block, hot, huge-page "
                         "memory, as ucx_perftest) or walk (16 distinct blocks per batch in "
                         "plain heap memory)")
    ap.add_argument("--window", type=int, default=2,
                    help="batches kvbridge keeps in flight (default 2: one submitting while "
                         "one moves, as perftest keeps puts outstanding; 1: one Transfer() at a "
                         "time)")
    ap.add_argument("--ucx", choices=("pypi", "system"), default=None,
                    help="which UCX both sides use (default: pypi when the build has "
                         "plugins_ucx_pypi, else system)")
    a = ap.parse_args()
    if a.window < 1:
        ap.error(f"argument --window: {a.window}: at least 1")
    if a.ucx is None:
        has_pypi = os.path.exists(os.path.join(a.build, "plugins_ucx_pypi",
                                               "libkvb_transport_ucx.so"))
        a.ucx = "pypi" if has_pypi else "system"
    pt_bin, pt_env, kvb_env, ucx_version = ucx_choice(a.ucx, a.build)
    ucp_bin = ucp_binary(a.ucx, a.build)
    if ucp_bin is None:
        log(f"ucx bench: no kvb_bench_ucp for --ucx {a.ucx} in {a.build}: no plain-UCP column")
    elif a.shape != "perftest":
        # kvb_bench_ucp moves one hot block, the perftest shape only
        log(f"ucx bench: --shape {a.shape}: no plain-UCP column (it moves one block)")
        ucp_bin = None
    log(f"ucx bench: UCX {ucx_version} ({a.ucx})")
    blocks = a.blocks or ([65536, MIB] if a.quick else [65536, 262144, MIB, 4 * MIB])
    seconds = a.seconds or (1.0 if a.quick else 2.0)
    sets = [s for s in a.sets.split(",") if s]
    unknown = [s for s in sets if s not in TLS_SETS]
    if unknown or not sets:
        ap.error(f"argument --sets: {a.sets!r}: each set is one of {', '.join(TLS_SETS)}")

    rounds = a.rounds or 1
    ops = (("write", "ucp_put_bw"), ("read", "ucp_get"))
    # One cell is measured per (set, op, block) and round, kvbridge and ucx_perftest back to
    # back on that one op (this VM's speed shifts between a fast and a slow mode every few tens
    # of seconds, for both programs alike: a pair measured seconds apart can straddle a shift,
    # and measuring every kvbridge point first and every perftest point after them skewed whole
    # runs' ratios by 0.6x or 1.8x), their order alternating by round.
    # Plain UCP is measured in the same pair, third (or first, in odd rounds).
    # samples[(set, op, block)]: per round (kvb, perftest, tcp, failures, plain UCP).
    samples = {}
    for rnd_i in range(rounds):
        for block in blocks:
            log(f"ucx bench: round {rnd_i + 1}/{rounds}, {block} B: kvbridge tcp plugin ...")
            tcp = kvb_bench(a.build, "tcp", [block], seconds, [], a.shape, a.window)
            for set_name in sets:
                tls = TLS_SETS[set_name]
                iters = max(200, min(20000, int(2e9 * seconds / 4 / block)))
                kvb_args = (a.build, "ucx", [block], seconds,
                            [f"ucx.tls={tls['tls']}", f"ucx.same_host={tls['same_host']}"],
                            a.shape, a.window, kvb_env)
                for op, test in ops:
                    if rnd_i % 2 == 0:
                        k_gbps, k_fail = kvb_ucx(set_name, tls, op, block, kvb_args)
                        pt = perftest_op(pt_bin, pt_env, test, block, iters, tls)
                        ucp = ucp_op(ucp_bin, pt_env, op, block, seconds, a.window, tls)
                    else:
                        ucp = ucp_op(ucp_bin, pt_env, op, block, seconds, a.window, tls)
                        pt = perftest_op(pt_bin, pt_env, test, block, iters, tls)
                        k_gbps, k_fail = kvb_ucx(set_name, tls, op, block, kvb_args)
                    samples.setdefault((set_name, op, block), []).append(
                        (k_gbps, pt, tcp[(op, block)][0], k_fail, ucp))
    results, failures = {}, 0
    for set_name in sets:
        results[set_name] = {}
        for op, _ in ops:
            results[set_name][op] = {}
            for block in blocks:
                rs = samples[(set_name, op, block)]
                k_gbps = median(r[0] for r in rs)
                pt = median(r[1] for r in rs)
                t_gbps = median(r[2] for r in rs)
                k_fail = sum(r[3] for r in rs)
                failures += k_fail
                mc = memcpy_gbps(block)
                row = {
                    "ucx_perftest_gbps": rnd(pt),
                    "kvb_ucx_gbps": rnd(k_gbps),
                    "kvb_tcp_gbps": rnd(t_gbps),
                    "memcpy_gbps": rnd(mc),
                    # the median of the rounds' own ratios (each a back-to-back pair)
                    "ratio_vs_perftest": rnd(median_ratio((r[0], r[1]) for r in rs)),
                    "ratio_vs_tcp": rnd(median_ratio((r[0], r[2]) for r in rs)),
                    "ratio_vs_memcpy": ratio(k_gbps, mc),
                    "ratios_vs_perftest_per_round": [ratio(r[0], r[1]) for r in rs],
                    # plain UCP with kvbridge's completion rule (None without kvb_bench_ucp)
                    "ucp_flushed_gbps": rnd(median(r[4] for r in rs if r[4] is not None)),
                    "ratio_vs_ucp_flushed": rnd(median_ratio((r[0], r[4]) for r in rs)),
                    "ucp_flushed_vs_perftest": rnd(median_ratio((r[4], r[1]) for r in rs)),
                    "kvb_ucx_failures": k_fail,
                }
                results[set_name][op][str(block)] = row
                log(f"  {set_name} {op} {block}: {row}")
    big = [b for b in blocks if b >= MIB]
    rows = [r for s in results.values() for o in s.values() for r in o.values()]
    goals = {
        "vs_perftest_ge_0_9": all((r["ratio_vs_perftest"] or 0) >= 0.9 for r in rows),
        "sm_vs_tcp_ge_3_at_1MiB": bool(big) and "sm" in results and all(
            (results["sm"][op][str(b)]["ratio_vs_tcp"] or 0) >= 3 for op in ("write", "read")
            for b in big),
    }
    # Headline: the row where kvbridge over UCX is furthest behind ucx_perftest.
    worst = min(rows, key=lambda r: r["ratio_vs_perftest"] or 0.0, default=None)
    headline = {
        "metric": "kvbridge over UCX GB/s / ucx_perftest GB/s, the lowest over sets, ops and "
                  "blocks",
        "value": worst["kvb_ucx_gbps"] if worst else None,
        "baseline": worst["ucx_perftest_gbps"] if worst else None,
        "baseline_name": "ucx_perftest ucp_put_bw (writes) / ucp_get (reads) with the same "
                         "UCX_TLS, same run",
        "ratio": worst["ratio_vs_perftest"] if worst else None, "goal": 0.9}
    emit({"benchmark": "ucx", "quick": a.quick, "seconds": seconds, "rounds": rounds,
          "ucx": a.ucx,
          "ucx_version": ucx_version,
          "shape": a.shape,
          "shape_detail": f"kvbridge: 1 thread, batches of 16 ops, {a.window} in flight, "
                          + " ".join(SHAPES[a.shape]) + "; ucx_perftest: its defaults; plain "
                          f"UCP (kvb_bench_ucp): batches of 16 ops of one block, {a.window} in "
                          "flight, a put batch ending with an endpoint flush",
          "headline": headline, "results": results, "goals": goals})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
