"""Adds the machine facts a benchmark's figures depend on to its JSON result line.

    benchmarks/environment.py [--loadavg "1.0 0.5 0.2"] [--halt-poll-set-by-run]
        [--halt-poll-param PATH] < benchmark-stdout > same-with-environment

Reads a benchmark's whole stdout on stdin and writes it back with one key added to the last
line's JSON object: "environment". Any other line passes through unchanged; a last line that
is not a JSON object (a benchmark that failed) is left as it is.

Why: on a virtual machine, small synchronous transfers between two local processes are bound
by how fast a halted vCPU wakes up, which the guest's halt polling decides
(docs/performance.md, "Guest halt polling"); figures from two runs compare only when these
facts match.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HALT_POLL_PARAM = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def virtualized() -> bool | None:
    info = read_text("/proc/cpuinfo")
    if info is None:
        return None
    for line in info.splitlines():
        if line.startswith("flags"):
            return "hypervisor" in line.split()
    return None


def environment(halt_poll_param: str, loadavg: str | None, set_by_run: bool) -> dict:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--halt-poll-param", default=HALT_POLL_PARAM)
    ap.add_argument("--halt-poll-set-by-run", action="store_true")
    ap.add_argument("--loadavg", default=None, help="/proc/loadavg as read before the run")
    args = ap.parse_args()
    lines = sys.stdin.read().splitlines()
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = None
        if isinstance(result, dict):
            result["environment"] = environment(args.halt_poll_param, args.loadavg,
                                                args.halt_poll_set_by_run)
            lines[-1] = json.dumps(result)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
