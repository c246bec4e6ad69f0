#!/usr/bin/env python3
"""The project's Markdown pages stand on their own: a page never repeats a top-level (#, ##)
section (a merge or an edit that pasted a page into itself), never links outside the
repository, and every relative link points at a file that exists. Run by `make lint` over
README.md, docs/ and every README under the tree; prints each problem as path:line: what, and
exits 1 if there was any.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "*.md"], capture_output=True,
                         text=True, check=True).stdout.split()
    return [p for p in out if p == "README.md" or p.startswith("docs/")
            or os.path.basename(p) == "README.md"]


def check(path):
    problems = []
    seen = {}
    in_fence = False
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if re.match(r"^##? ", line):
            if line in seen:
                problems.append(f"{path}:{n}: heading {line!r} repeats line {seen[line]}")
            else:
                seen[line] = n
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file_part = target.split("#", 1)[0]
            resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file_part))
            if not resolved.startswith(ROOT + os.sep) and resolved != ROOT:
                problems.append(f"{path}:{n}: link {target!r} leaves the repository")
            elif not os.path.exists(resolved):
                problems.append(f"{path}:{n}: link {target!r} points at nothing")
    return problems


def main():
    problems = []
    for p in pages():
        problems += check(p)
    for p in problems:
        print(p)
    if problems:
        print(f"check_docs: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
