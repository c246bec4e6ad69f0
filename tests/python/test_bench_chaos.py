"""benchmarks/bench_chaos.py end to end in its shortest mode (--tiny: 5 s of load, the
failure at 2 s), kvbridge alone, one scenario: the JSON has every figure the docs name and the
timeline files are written. The figures themselves are not judged here (a busy machine moves
them); docs/benchmarks.md has measured ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvbridge

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_chaos.py"
# build/python/kvbridge -> build (not resolve(): the build tree stages symlinks)
BUILD = Path(os.path.abspath(kvbridge.__file__)).parent.parent.parent
DAEMON = BUILD / "bin" / "kvbridge"


@pytest.mark.skipif(not DAEMON.exists(), reason=f"{DAEMON} is not built (not a build-tree run)")
def test_a_tiny_kill_run_reports_every_figure(tmp_path):
    out = tmp_path / "chaos"
    r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--systems", "kvbridge",
                        "--scenario", "kill-holder", "--clients", "1", "--threads", "2",
                        "--build", str(BUILD), "--out", str(out)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.splitlines()[-1])
    assert doc["benchmark"] == "chaos"
    run = doc["scenarios"]["kill-holder"]["systems"]["kvbridge"]
    assert "error" not in run, run
    assert isinstance(run["failed_ops"], int)
    assert set(run["failed"]) == {"error", "wrong_bytes", "lost", "hung"}
    assert run["failed_ops"] == sum(run["failed"].values())
    assert run["ops"] > 0 and run["gets_checked"] > 0
    for key in ("stall_seconds", "stall_seconds_before_failure", "baseline_mb_per_s",
                "time_to_recover_s", "recovered", "latency", "latency_failure_window"):
        assert key in run
    for lat in (run["latency"], run["latency_failure_window"]):
        assert set(lat) == {"ops", "p50_ms", "p99_ms", "max_ms"}
    assert run["events"][0]["what"].startswith("storage process 0 killed")
    head = doc["headline"]
    assert isinstance(head["failed_ops"]["kvbridge"], int)
    assert "stall_seconds_ratio" in head  # null without Mooncake
    timeline = json.loads((out / "kill-holder.json").read_text())
    tl = timeline["systems"]["kvbridge"]["timeline"]
    assert len(tl["mb_per_s"]) == len(tl["failed_ops"]) > 0
