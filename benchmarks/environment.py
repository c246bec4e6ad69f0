"""Adds the machine facts a benchmark's figures depend on to its JSON result line.

    benchmarks/environment.py [--loadavg "1.0 0.5 0.2"] [--halt-poll-set-by-run]
        [--halt-poll-param PATH] < benchmark-stdout > same-with-environment

Reads a benchmark's whole stdout on stdin and writes it back with one key added to the last
line's JSON object: "environment". Any other line passes through unchanged; a last line that
is not a JSON object (a benchmark that failed) is left as it is.

Why: on a virtual machine, small synchronous transfers between two local processes are bound
by how fast a halted vCPU wakes up, which the guest's halt polling decides
(docs/performance.md, "Guest halt polling"); figures from two runs compare only when these
facts match. The facts themselves are benchlib.environment() (benchmarks/benchlib.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchlib import HALT_POLL_PARAM, environment


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
