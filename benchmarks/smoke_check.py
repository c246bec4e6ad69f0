"""CTest smoke for one C++ benchmark (benchmarks/CMakeLists.txt):

    smoke_check.py NAME PROGRAM [FLAGS...]

Runs PROGRAM --help (exit 0, lists its flags), PROGRAM --no-such-flag (exit 2, the flag named
on stderr), then PROGRAM FLAGS (its quickest run): exit 0, and the last stdout line is one JSON
object whose "benchmark" is NAME and whose "headline" has the keys every benchmark's headline
has (docs/benchmarks.md, "The JSON result"), with positive value, baseline and ratio. Exit
status 1 with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEADLINE_KEYS = ("metric", "value", "baseline", "baseline_name", "ratio")


def fail(msg: str) -> int:
    print(f"smoke_check: {msg}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        return fail("usage: smoke_check.py NAME PROGRAM [FLAGS...]")
    name, prog, flags = argv[0], argv[1], argv[2:]
    h = subprocess.run([prog, "--help"], capture_output=True, text=True, timeout=30)
    if h.returncode != 0 or "--quick" not in h.stdout:
        return fail(f"{prog} --help: exit {h.returncode}, stdout {h.stdout!r}")
    u = subprocess.run([prog, "--no-such-flag"], capture_output=True, text=True, timeout=30)
    if u.returncode != 2 or "unknown flag --no-such-flag" not in u.stderr:
        return fail(f"{prog} --no-such-flag: exit {u.returncode}, stderr {u.stderr!r}")
    r = subprocess.run([prog, *flags], capture_output=True, text=True, timeout=120)
    sys.stderr.write(r.stderr)
    if r.returncode != 0:
        return fail(f"{prog} {' '.join(flags)} exited {r.returncode}")
    lines = r.stdout.strip().splitlines()
    if not lines:
        return fail("no stdout")
    try:
        res = json.loads(lines[-1])
    except ValueError as e:
        return fail(f"the last stdout line is not JSON ({e}): {lines[-1][:300]!r}")
    if not isinstance(res, dict):
        return fail("the last stdout line is not a JSON object")
    if res.get("benchmark") != name:
        return fail(f"\"benchmark\" is {res.get('benchmark')!r}, not {name!r}")
    head = res.get("headline", {})
    missing = [k for k in HEADLINE_KEYS if k not in head]
    if missing:
        return fail(f"headline lacks {missing}: {head}")
    for k in ("value", "baseline", "ratio"):
        if not isinstance(head[k], (int, float)) or head[k] <= 0:
            return fail(f"headline {k} is {head[k]!r}, not a positive number: {head}")
    print(json.dumps(res["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
