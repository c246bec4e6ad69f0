"""Makes the project venv's torch importable in another venv of the same interpreter, without a
second install: torch (a few GB with its CUDA libraries) would otherwise be downloaded again for
.venv-mooncake, whose tensor API (``put_tensor``, ``get_tensor``, ...) imports torch.

Run with the project venv's python (the one that has torch):

    .venv/bin/python scripts/link_project_torch.py DEST_DIR TARGET_SITE_PACKAGES

DEST_DIR gets one symlink per top-level module and ``*.dist-info`` of torch, numpy and
everything torch requires (followed recursively, with extras and markers evaluated here),
except distributions the target venv has itself (they stay its own), and
TARGET_SITE_PACKAGES gets ``kvbridge-project-torch.pth`` naming DEST_DIR. A ``.pth`` path is
appended to ``sys.path``, so the target venv's own packages still come first. Nothing else of
the project venv (pytest, its plugins, kvbridge) becomes visible there. Idempotent: DEST_DIR is
rebuilt from scratch each time. Prints the number of distributions linked.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import sys
from pathlib import Path

PTH_NAME = "kvbridge-project-torch.pth"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots: list[str], skip: set[str]) -> list[md.Distribution]:
    """The roots and their requirements, recursively, extras included (torch's CUDA libraries
    come as extras of cuda-toolkit): the distributions installed here, less those in skip."""
    from packaging.requirements import Requirement  # a dependency of pip and of torch's tooling

    seen: dict[str, md.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(r, "") for r in roots]
    while todo:
        name, extra = todo.pop()
        name = _norm(name)
        if name in skip or (name, extra) in done:
            continue
        done.add((name, extra))
        try:
            dist = seen.get(name) or md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional or platform dependency not installed here
        seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo.append((req.name, ""))
                todo.extend((req.name, e) for e in req.extras)
    return list(seen.values())


def _top_level(dist: md.Distribution) -> set[str]:
    """The first path components a distribution installs into site-packages (its packages,
    modules and dist-info), from its RECORD."""
    names = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        names.add(first)
    return names


def main() -> int:
    dest, target = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    import torch  # noqa: F401 (fails here, naming why, when the project venv has no torch)

    site = Path(torch.__file__).resolve().parents[1]
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    # What the target venv installs itself (setuptools, pip) stays its own.
    skip = {_norm(p.name.split("-")[0]) for p in target.glob("*.dist-info")}
    # numpy is optional for torch, but tensors' numpy interop (and torch's warning at import
    # without it) wants it.
    dists = _closure(["torch", "numpy"], skip)
    for dist in dists:
        for name in _top_level(dist):
            src = site / name
            if src.exists() and not (dest / name).exists():
                os.symlink(src, dest / name)
    (target / PTH_NAME).write_text(f"{dest}\n")
    print(len(dists))
    return 0


if __name__ == "__main__":
    sys.exit(main())
