"""What every Python benchmark in benchmarks/ shares (docs/benchmarks.md); the C++ benchmarks
have the same in benchmarks/benchlib/benchlib.h.

- percentile(values, p): the ONE percentile rule of the project, nearest rank: the smallest
  sample x such that at least p% of the samples are <= x, i.e. the sorted sample at rank
  ceil(p/100 * n) (1-based), rank 1 for p = 0. p0 is the minimum, p100 the maximum, p50 of an
  even count the lower of the two middle samples. No samples: None (null in the JSON).
- median(values) = percentile(values, 50); summary(values): count, min, mean, p50, p99, max.
- gbps(nbytes, seconds): GB/s with 1 GB = 1e9 bytes. ratio(value, baseline): value / baseline,
  rounded, None when either is missing or the baseline is not > 0.
- parser(doc, ...): an argparse parser with the flags the benchmarks share (--quick,
  --seconds, --rounds); argparse names an unknown flag or a bad value and exits 2.
  int_list: an argparse type for "65536,1048576".
- environment(...): the machine facts a result depends on (CPU count, kernel, halt polling...),
  the "environment" key benchmarks/run adds to every result (benchmarks/environment.py).
- emit(result): prints the result dict as the last stdout line (one JSON object).

Only the standard library: the benchmarks run under several interpreters (the project venv,
.venv-mooncake, .venv-engines, the system python3).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import socket
import sys
import time
from typing import Iterable, Optional

HALT_POLL_PARAM = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"


# ------------------------------------------------------------------------- percentiles, stats

def percentile(values: Iterable[float], p: float) -> Optional[float]:
    """Nearest-rank p-th percentile (p in 0..100, clamped); None when there are no values."""
    s = sorted(values)
    if not s:
        return None
    p = min(100.0, max(0.0, float(p)))
    # The 1e-9 keeps a product that binary rounding puts just above a whole number
    # (0.29 * 100 = 29.000000000000004) at that number; benchlib.cc does the same.
    rank = math.ceil(p / 100.0 * len(s) - 1e-9)
    return s[min(len(s), max(1, rank)) - 1]


def median(values: Iterable[float]) -> Optional[float]:
    return percentile(values, 50)


def summary(values: Iterable[float]) -> dict:
    v = list(values)
    return {"count": len(v), "min": percentile(v, 0), "mean": sum(v) / len(v) if v else None,
            "p50": percentile(v, 50), "p99": percentile(v, 99), "max": percentile(v, 100)}


# -------------------------------------------------------------------------------- rates

def gbps(nbytes: float, seconds: float) -> float:
    """GB/s, 1 GB = 1e9 bytes; 0.0 when no time passed."""
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else 0.0


def rnd(x: Optional[float], digits: int = 3) -> Optional[float]:
    return None if x is None else round(x, digits)


def ratio(value: Optional[float], baseline: Optional[float], digits: int = 3) -> Optional[float]:
    """value / baseline rounded to `digits`; None when either is None or baseline <= 0."""
    if value is None or baseline is None or not baseline > 0:
        return None
    return round(value / baseline, digits)


# -------------------------------------------------------------------------------- flags

def int_list(text: str) -> list[int]:
    """argparse type: comma-separated non-negative integers ("65536,1048576")."""
    out = []
    for item in text.split(","):
        if not item.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not a non-negative integer")
        out.append(int(item))
    return out


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return v


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return v


def parser(doc: str, quick: str = "a short run", seconds: Optional[str] = None,
           rounds: Optional[str] = None) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first paragraph of `doc`, with --quick (help
    `quick`), and --seconds / --rounds when their help is given (default None: the benchmark
    picks by --quick). Unknown flags and bad values exit 2 with the flag named (argparse)."""
    ap = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    if seconds is not None:
        ap.add_argument("--seconds", type=positive_float, default=None, help=seconds)
    if rounds is not None:
        ap.add_argument("--rounds", type=positive_int, default=None, help=rounds)
    return ap


# -------------------------------------------------------------------------- environment

def read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def virtualized() -> Optional[bool]:
    info = read_text("/proc/cpuinfo")
    if info is None:
        return None
    for line in info.splitlines():
        if line.startswith("flags"):
            return "hypervisor" in line.split()
    return None


def environment(halt_poll_param: str = HALT_POLL_PARAM, loadavg: Optional[str] = None,
                set_by_run: bool = False) -> dict:
    """The machine facts the figures depend on (docs/performance.md, "Guest halt polling")."""
    hp = read_text(halt_poll_param)
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "virtualized": virtualized(),
        "cpuidle_driver": read_text("/sys/devices/system/cpu/cpuidle/current_driver"),
        # null: this kernel has no guest halt polling (not a KVM guest, or no cpuidle-haltpoll)
        "guest_halt_poll_ns": int(hp) if hp is not None and hp.isdigit() else None,
        "guest_halt_poll_set_by_run": set_by_run,
        "tcp_congestion_control": read_text("/proc/sys/net/ipv4/tcp_congestion_control"),
        "loadavg_at_start": [float(x) for x in loadavg.split()[:3]] if loadavg else None,
    }


# ------------------------------------------------------------------------------- report

def emit(result: dict) -> None:
    """Prints `result` as the last stdout line: one JSON object (NaN/inf become null)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    sys.stderr.flush()
    print(json.dumps(clean(result)), flush=True)


def free_port(lo: int = 0, hi: int = 0) -> int:
    """A loopback TCP port nobody listens on: any (lo = 0) or one in [lo, hi]."""
    for _ in range(200):
        want = random.randint(lo, hi) if lo else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", want))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{lo}, {hi}]")


def wait_port(port: int, timeout_s: float, what: str) -> None:
    """Returns once something accepts connections on the loopback `port`; RuntimeError naming
    `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {port} within {timeout_s} s") from e
            time.sleep(0.05)
