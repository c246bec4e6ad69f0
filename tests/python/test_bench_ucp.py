"""kvb_bench_ucp, the plain-UCP baseline of benchmarks/run ucx (benchmarks/bench_ucp.cc): it
moves bytes over real UCX between two real processes in both endpoint modes and prints its JSON
line; a bad flag is named. Its figures are not judged here (docs/transports/ucx.md has them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import kvbridge

# build/python/kvbridge -> build (not resolve(): the build tree stages symlinks)
BUILD = Path(os.path.abspath(kvbridge.__file__)).parent.parent.parent
UCP = BUILD / "benchmarks" / "kvb_bench_ucp"

pytestmark = pytest.mark.skipif(not UCP.exists(),
                                reason=f"{UCP} is not built (no UCX, or not a build-tree run)")


def bench(tls: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(UCP), "--seconds", "0.2", *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, UCX_TLS=tls))


@pytest.mark.parametrize("tls, mode, block", [
    ("tcp,self", ["--peer-mode"], 65536),        # the benchmark's "tcp" set
    ("sysv,posix,cma,self", [], 1 << 20),       # its "sm" set
])
@pytest.mark.parametrize("op", ["write", "read"])
def test_it_moves_bytes_and_prints_one_json_line(tls, mode, block, op):
    r = bench(tls, "--op", op, "--block", str(block), *mode)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["benchmark"] == "ucp"
    assert res["op"] == op and res["block_bytes"] == block
    assert res["peer_mode"] is bool(mode)
    assert res["gbps"] > 0
    assert res["seconds"] >= 0.2


def test_a_bad_op_is_named_and_nothing_runs():
    r = bench("tcp,self", "--op", "put")
    assert r.returncode == 2
    assert "bad value 'put' for --op: one of write, read" in r.stderr
    assert r.stdout == ""
