"""benchmarks/bench_vs_mooncake.py's store cells without running a store: the cell list, the
flags that select cells, pooling rounds (rates over succeeded objects, failures kept per round)
and the per-cell ratios with their failure flag. Neither kvbridge nor Mooncake is imported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_vs_mooncake as bvm  # noqa: E402


def test_sizes_modes_and_profile_cell_flags():
    assert bvm.size_list("1m,1k,16KiB,64kb") == [1 << 10, 16 << 10, 64 << 10, 1 << 20]
    assert bvm.size_list("1024,1k") == [1 << 10]
    with pytest.raises(argparse.ArgumentTypeError):
        bvm.size_list("4k")
    assert bvm.mode_list("embedded,remote") == ["remote", "embedded"]
    with pytest.raises(argparse.ArgumentTypeError):
        bvm.mode_list("local")
    assert bvm.profile_cell("embedded:1k:batch_get_into") == ("embedded", 1 << 10,
                                                              "batch_get_into")
    for bad in ("embedded:1k", "embedded:1k:get", "both:1k:batch_put_from"):
        with pytest.raises(argparse.ArgumentTypeError):
            bvm.profile_cell(bad)


def test_cells_batches_and_keys():
    cells = bvm.store_cells(["remote", "embedded"], sorted(bvm.KEYS_PER_BATCH))
    assert len(cells) == 9  # 2 modes x 4 sizes, plus remote 64 KiB at replica_num 2
    assert ("remote", 64 << 10, 2) in cells and ("embedded", 64 << 10, 2) not in cells
    for size, keys in bvm.KEYS_PER_BATCH.items():
        assert size * keys <= 16 << 20
    key = f"{bvm.key_prefix('kvbridge', 'embedded', 1024, 1, 0)}-{0:05x}{511:04x}"
    assert len(key) == bvm.KEY_BYTES


def row(system, op, ok, lat, failed, mode="embedded", size=1 << 10):
    fields = {"system": system, "mode": mode, "op": op, "object_bytes": size,
              "keys_per_batch": bvm.KEYS_PER_BATCH[size], "key_bytes": bvm.KEY_BYTES,
              "replica_num": 1}
    return bvm.store_row(fields, size, lat, ok, failed)


def test_rounds_pool_over_succeeded_objects_and_keep_failures_per_round():
    merged = bvm.merge_store_rounds([
        row("kvbridge", "batch_get_into", 1024, [0.01, 0.01], 0),
        row("kvbridge", "batch_get_into", 1000, [0.02, 0.02], 24),
    ])
    assert len(merged) == 1
    m = merged[0]
    assert m["objs_per_s"] == pytest.approx(2024 / 0.06, abs=0.1)
    assert m["failures"] == 24 and m["failures_per_round"] == [0, 24]
    assert m["batches"] == 4 and m["rounds"] == 2


def test_ratios_flag_cells_with_failures_and_name_them():
    rows = bvm.merge_store_rounds([
        row("kvbridge", "batch_put_from", 512, [0.01], 0),
        row("mooncake", "batch_put_from", 512, [0.02], 0),
        row("kvbridge", "batch_get_into", 500, [0.01], 12),
        row("mooncake", "batch_get_into", 512, [0.005], 0),
    ])
    ratios = {x["cell"]: x for x in bvm.store_ratios(rows)}
    put, get = ratios["embedded:1KiB:batch_put_from:r1"], ratios["embedded:1KiB:batch_get_into:r1"]
    assert put["ratio"] == pytest.approx(2.0) and not put["failed"]
    assert get["failed"] and get["failures"] == 12
    assert get["ratio"] == pytest.approx(500 / 0.01 / (512 / 0.005), abs=1e-3)
