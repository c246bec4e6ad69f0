"""benchmarks/benchlib.py: the percentile rule (nearest rank, the same as the C++
benchmarks/benchlib), rates and ratios, the shared flags' errors as a user sees them from a
real benchmark process, the JSON result line and the environment block that benchmarks/run
adds through benchmarks/environment.py."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import benchlib  # noqa: E402


def test_nearest_rank_on_one_to_hundred():
    v = list(range(100, 0, -1))  # unsorted on purpose
    assert benchlib.percentile(v, 0) == 1
    assert benchlib.percentile(v, 1) == 1
    assert benchlib.percentile(v, 29) == 29  # 0.29 * 100 is 29.000000000000004 in binary
    assert benchlib.percentile(v, 50) == 50
    assert benchlib.percentile(v, 50.5) == 51
    assert benchlib.percentile(v, 99) == 99
    assert benchlib.percentile(v, 99.5) == 100
    assert benchlib.percentile(v, 100) == 100
    assert v == list(range(100, 0, -1))  # the caller's list is not sorted in place


@pytest.mark.parametrize("values, p, want", [
    ([7.5], 0, 7.5), ([7.5], 50, 7.5), ([7.5], 100, 7.5),  # one sample: every percentile
    ([20, 10], 0, 10), ([20, 10], 50, 10), ([20, 10], 50.1, 20), ([20, 10], 100, 20),
    ([5, 1, 4, 2, 3], 50, 3), ([5, 1, 4, 2, 3], 20, 1), ([5, 1, 4, 2, 3], 21, 2),
    ([5, 1, 4, 2, 3], 99, 5),
    ([5, 1, 4, 2, 3], -5, 1), ([5, 1, 4, 2, 3], 250, 5),  # p is clamped to 0..100
])
def test_percentile_edges(values, p, want):
    assert benchlib.percentile(values, p) == want


def test_no_samples_is_none_not_zero():
    assert benchlib.percentile([], 50) is None
    assert benchlib.median([]) is None
    assert benchlib.summary([]) == {"count": 0, "min": None, "mean": None, "p50": None,
                                    "p99": None, "max": None}


def test_median_of_an_even_count_is_the_lower_middle_sample():
    # statistics.median would say 2.5: the benchmarks use one rule, nearest rank
    assert benchlib.median([4, 1, 3, 2]) == 2
    assert benchlib.summary([0, 1, 2, 3, 10, 11]) == {"count": 6, "min": 0, "mean": 27 / 6,
                                                      "p50": 2, "p99": 11, "max": 11}


def test_gbps_ratio_and_rounding():
    assert benchlib.gbps(3e9, 2) == 1.5
    assert benchlib.gbps(1 << 30, 1) == 1.073741824  # decimal GB, not GiB
    assert benchlib.gbps(100, 0) == 0.0
    assert benchlib.ratio(3, 2) == 1.5
    assert benchlib.ratio(1, 3) == 0.333
    assert benchlib.ratio(1, 3, 1) == 0.3
    assert benchlib.ratio(3, 0) is None
    assert benchlib.ratio(3, -1) is None
    assert benchlib.ratio(None, 2) is None
    assert benchlib.ratio(2, None) is None
    assert benchlib.rnd(None) is None
    assert benchlib.rnd(1.23456) == 1.235


def test_parser_shared_flags_and_their_errors(capsys):
    ap = benchlib.parser("Does things.\n\nMore.", quick="short", seconds="s", rounds="r")
    ap.add_argument("--blocks", type=benchlib.int_list, default=None)
    a = ap.parse_args(["--quick", "--seconds", "0.5", "--rounds", "2", "--blocks", "1,22"])
    assert (a.quick, a.seconds, a.rounds, a.blocks) == (True, 0.5, 2, [1, 22])
    a = ap.parse_args([])
    assert (a.quick, a.seconds, a.rounds, a.blocks) == (False, None, None, None)
    assert ap.description == "Does things."
    for args, why in [(["--seconds", "fast"], "argument --seconds: 'fast' is not a number"),
                      (["--seconds", "0"], "argument --seconds: '0' is not a positive number"),
                      (["--seconds", "nan"], "'nan' is not a positive number"),
                      (["--rounds", "0"], "argument --rounds: '0' is not a positive integer"),
                      (["--rounds", "1.5"], "argument --rounds: '1.5' is not an integer"),
                      (["--blocks", "1,,2"], "argument --blocks: '' in '1,,2' is not a"),
                      (["--blocks", "-1"], "argument --blocks: '-1' in '-1' is not a"),
                      (["--no-such"], "unrecognized arguments: --no-such")]:
        with pytest.raises(SystemExit) as e:
            ap.parse_args(args)
        assert e.value.code == 2
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("args, why", [
    (["--blocks", "65536,x"], "argument --blocks: 'x' in '65536,x' is not a non-negative"),
    (["--sets", "sm,rdma"], "argument --sets: 'sm,rdma': each set is one of sm, tcp"),
    (["--seconds", "-1"], "argument --seconds: '-1' is not a positive number"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_benchmark_names_a_bad_flag_and_exits_2(args, why):
    # bench_ucx.py imports only the standard library and benchlib: a real process, as
    # benchmarks/run starts it; the bad flag is refused before anything is measured
    r = subprocess.run([sys.executable, str(BENCH / "bench_ucx.py"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert why in r.stderr
    assert r.stdout == ""


def test_emit_prints_one_json_line_with_nan_as_null(capsys):
    benchlib.emit({"benchmark": "x", "value": float("nan"), "rows": [{"r": math.inf}, 1.5],
                   "name": 'a "quoted"\nname'})
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    assert json.loads(out) == {"benchmark": "x", "value": None, "rows": [{"r": None}, 1.5],
                               "name": 'a "quoted"\nname'}


def test_environment_block(tmp_path):
    param = tmp_path / "guest_halt_poll_ns"
    param.write_text("123\n")
    env = benchlib.environment(str(param), "0.5 1.25 2 3/400 5", True)
    assert env["cpus"] == os.cpu_count()
    assert env["kernel"] == platform.release()
    assert env["guest_halt_poll_ns"] == 123
    assert env["guest_halt_poll_set_by_run"] is True
    assert env["loadavg_at_start"] == [0.5, 1.25, 2.0]
    env = benchlib.environment(str(tmp_path / "absent"), None, False)
    assert env["guest_halt_poll_ns"] is None
    assert env["loadavg_at_start"] is None


def test_environment_py_adds_the_block_to_the_last_line_only(tmp_path):
    param = tmp_path / "p"
    param.write_text("7")

    def run(stdin: str) -> list[str]:
        r = subprocess.run([sys.executable, str(BENCH / "environment.py"), "--halt-poll-param",
                            str(param), "--loadavg", "1 2 3"], input=stdin,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    lines = run('progress {"not": "last"}\n{"benchmark": "t", "headline": {"ratio": 1.5}}\n')
    assert lines[0] == 'progress {"not": "last"}'
    res = json.loads(lines[1])
    assert res["headline"] == {"ratio": 1.5}
    assert res["environment"]["guest_halt_poll_ns"] == 7
    assert res["environment"]["loadavg_at_start"] == [1.0, 2.0, 3.0]
    # a failed benchmark's last line, not a JSON object, passes through as it is
    assert run("partial\nTraceback: boom\n") == ["partial", "Traceback: boom"]
    assert run("[1, 2]\n") == ["[1, 2]"]
