"""benchmarks/run as a user runs it: the "environment" key of its result and the
--guest-halt-poll-ns flag (set for the run, restored after, bad values named).

The halt-polling tests point the wrapper at a stand-in file (KVBRIDGE_HALT_POLL_PARAM) so that
they check setting and restoring without changing this machine's idle behaviour under other
tests; the real sysfs file is only read.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest

import kvbridge

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run"
# build/python/kvbridge -> build (not resolve(): the build tree stages symlinks)
BUILD = Path(os.path.abspath(kvbridge.__file__)).parent.parent.parent
TRANSFER = BUILD / "benchmarks" / "kvb_bench_transfer"
SYS_HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
SMALL = ["--quick", "--blocks", "65536", "--seconds", "0.2", "--threads", "1"]

needs_bench = pytest.mark.skipif(not TRANSFER.exists(),
                                 reason=f"{TRANSFER} is not built (not a build-tree run)")


def run(args: list[str], tmp_path: Path, param: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, BUILD_DIR=str(BUILD), BENCH_OUT_DIR=str(tmp_path / "out"))
    if param is not None:
        env["KVBRIDGE_HALT_POLL_PARAM"] = str(param)
    return subprocess.run([str(RUN), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def result_of(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@needs_bench
def test_the_result_records_the_machine_it_ran_on(tmp_path):
    r = run(["transfer", *SMALL], tmp_path)
    res = result_of(r)
    env = res["environment"]
    assert env["cpus"] == os.cpu_count()
    assert env["kernel"] == platform.release()
    assert env["guest_halt_poll_set_by_run"] is False
    if SYS_HALT_POLL.exists():
        assert env["guest_halt_poll_ns"] == int(SYS_HALT_POLL.read_text())
    else:
        assert env["guest_halt_poll_ns"] is None
    assert len(env["loadavg_at_start"]) == 3
    # the file kept under the output directory is the same line
    saved = list((tmp_path / "out").glob("transfer-*.json"))
    assert len(saved) == 1
    assert json.loads(saved[0].read_text()) == res
    # the benchmark's own figures are still there
    assert res["benchmark"] == "transfer"


@needs_bench
def test_halt_polling_is_set_for_the_run_and_restored(tmp_path):
    param = tmp_path / "guest_halt_poll_ns"
    param.write_text("0\n")
    r = run(["transfer", *SMALL, "--guest-halt-poll-ns", "123456"], tmp_path, param)
    env = result_of(r)["environment"]
    assert env["guest_halt_poll_ns"] == 123456  # read while the benchmark's setting held
    assert env["guest_halt_poll_set_by_run"] is True
    assert "set to 123456 ns for this run (was 0" in r.stderr
    assert param.read_text().strip() == "0"

    # restored when the benchmark fails too, whose status the wrapper passes on
    param.write_text("7\n")
    r = run(["transfer", "--no-such-flag", "--guest-halt-poll-ns=200000"], tmp_path, param)
    assert r.returncode != 0
    assert param.read_text().strip() == "7"


@pytest.mark.parametrize("args, why", [
    (["--guest-halt-poll-ns", "fast"], "'fast' is not a number of nanoseconds"),
    (["--guest-halt-poll-ns", "4294967296"], "'4294967296' is not a number of nanoseconds"),
    (["--guest-halt-poll-ns", "-1"], "'-1' is not a number of nanoseconds"),
    (["--guest-halt-poll-ns"], "--guest-halt-poll-ns needs a value"),
])
def test_bad_halt_poll_values_are_named_and_change_nothing(tmp_path, args, why):
    param = tmp_path / "guest_halt_poll_ns"
    param.write_text("0\n")
    r = run(["transfer", *args], tmp_path, param)
    assert r.returncode == 2
    assert why in r.stderr
    assert param.read_text() == "0\n"
    assert not (tmp_path / "out").exists()  # no benchmark ran


def test_a_kernel_without_halt_polling_is_named(tmp_path):
    r = run(["transfer", "--guest-halt-poll-ns", "1000"], tmp_path, tmp_path / "absent")
    assert r.returncode == 2
    assert "does not exist; this kernel has no guest halt polling" in r.stderr


def test_an_unwritable_halt_poll_setting_is_named(tmp_path):
    # /proc/version: readable, and not writable even by root
    r = run(["transfer", "--guest-halt-poll-ns", "1000"], tmp_path, Path("/proc/version"))
    assert r.returncode == 2
    assert "cannot write /proc/version" in r.stderr
    r = run(["transfer", "--guest-halt-poll-ns", "1000"], tmp_path, tmp_path)  # a directory
    assert r.returncode == 2
    assert f"cannot read {tmp_path}" in r.stderr
