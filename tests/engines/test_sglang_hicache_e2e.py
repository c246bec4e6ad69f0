"""SGLang's offline engine with HiCache and kvbridge as its L3 storage, on CPU.

A kvbridge master and a storage node run as processes (tests/engines/harness.py). Process A,
an ``sgl.Engine`` with ``--hicache-storage-backend dynamic`` pointing at
kvbridge.integrations.sglang, runs two prompts and writes their KV pages to the store
(write_through). A fresh process B runs the same prompts: its prompt pages must come from
the store (``cached_tokens_details["storage"] > 0``), the backend's counters must show the
bytes it read, and its output ids must equal A's. In the failure test the storage node is
frozen and then killed (SIGKILL) while a fresh engine's load is blocked on it: the load
fails, the engine recomputes, and it answers with the same ids.

This file is also the engine role's script (run with ``role <json>``): SGLang spawns its
scheduler, which re-imports the main module, so the CPU shims (tests/engines/
sglang_cpu_shims.py, test-only) are applied here at import time when it runs as a script.

Run: .venv-engines/bin/python -m pytest tests/engines/test_sglang_hicache_e2e.py (docs/sglang.md).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

if __name__ in ("__main__", "__mp_main__"):  # the engine role and its spawned scheduler
    import sglang_cpu_shims

    sglang_cpu_shims.apply()

STATS_PREFIX = "kvbridge HiCache stats "
PAGE = 4


def _role(cfg: dict) -> None:
    """One engine process: build the engine, (optionally) wait for the go file, generate,
    (A) wait for the store to take the pages, print one JSON line, shut down."""
    import sglang as sgl

    import kvbridge

    extra = {"backend_name": "kvbridge", "module_path": "kvbridge.integrations.sglang",
             "class_name": "KvbridgeHiCacheStorage", "interface_v1": 1,
             "master": cfg["master"], "prefetch_threshold": 8, "log_stats_interval_s": 0.001,
             **cfg.get("extra", {})}
    t0 = time.monotonic()
    llm = sgl.Engine(model_path=cfg["model"], device="cpu", dtype="float32",
                     attention_backend="torch_native", sampling_backend="pytorch",
                     disable_cuda_graph=True, page_size=PAGE, mem_fraction_static=0.05,
                     max_total_tokens=4096, skip_server_warmup=True, random_seed=0,
                     enable_hierarchical_cache=True, hicache_io_backend="direct",
                     hicache_mem_layout=cfg["layout"], hicache_write_policy="write_through",
                     hicache_storage_prefetch_policy="wait_complete",
                     hicache_storage_backend="dynamic",
                     hicache_storage_backend_extra_config=json.dumps(extra), log_level="info")
    if cfg.get("warmup_prompt"):  # a prompt of its own: connects this client to the node
        llm.generate([cfg["warmup_prompt"]], {"temperature": 0, "max_new_tokens": 1})
    print(json.dumps({"event": "ready", "init_s": round(time.monotonic() - t0, 1)}), flush=True)
    if cfg.get("go_file"):
        deadline = time.monotonic() + 120
        while not os.path.exists(cfg["go_file"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    t1 = time.monotonic()
    outs = llm.generate(cfg["prompts"], {"temperature": 0, "max_new_tokens": 8,
                                         "ignore_eos": True})
    gen_s = time.monotonic() - t1
    status = None
    if cfg.get("wait_for_backup"):  # write_through backs pages up in the background
        last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + 30
        while time.monotonic() < deadline:
            status = kvbridge.cluster_status(cfg["master"])
            if status["objects"] != last:
                last, stable_since = status["objects"], time.monotonic()
            elif last > 0 and time.monotonic() - stable_since > 1.5:
                break
            time.sleep(0.1)
    result = {"event": "done", "gen_s": round(gen_s, 2),
              "outputs": [{"ids": o["output_ids"],
                           "cached": o["meta_info"].get("cached_tokens"),
                           "details": o["meta_info"].get("cached_tokens_details"),
                           "prompt_tokens": o["meta_info"].get("prompt_tokens")} for o in outs]}
    if status is not None:
        result["store"] = {k: status[k] for k in ("objects", "stored_bytes")}
    print(json.dumps(result), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    _role(json.loads(sys.argv[2]))
    sys.exit(0)

# -- the tests -----------------------------------------------------------------------------
import pytest  # noqa: E402

pytest.importorskip("sglang")
pytest.importorskip("kvbridge")

import harness  # noqa: E402

# The host layout of both engines: layer_first by default; page_first_direct also runs here
# (KVBRIDGE_SGLANG_E2E_LAYOUT=page_first_direct), through the shims' page-granular copies.
LAYOUT = os.environ.get("KVBRIDGE_SGLANG_E2E_LAYOUT", "layer_first")
READY_TIMEOUT = 180  # SGLang's start on 2 busy cores: 20-60 s measured
DONE_TIMEOUT = 120


def _engine(name, cfg, log_dir):
    return harness.python_role(name, __file__, ["role", json.dumps(cfg)], harness.engine_env(),
                               log_dir)


def _stats_lines(role) -> list:
    """The counters the backend logged in that engine's scheduler, oldest first."""
    out = []
    for line in role.err_path.read_text(errors="replace").splitlines():
        i = line.find(STATS_PREFIX)
        if i >= 0:
            out.append(json.loads(line[i + len(STATS_PREFIX):]))
    return out


def _run(name, cfg, log_dir, before_go=None) -> tuple[dict, dict]:
    with _engine(name, cfg, log_dir) as role:
        role.wait_json(lambda d: d.get("event") == "ready", READY_TIMEOUT)
        if before_go is not None:
            before_go(role)
        done = role.wait_json(lambda d: d.get("event") == "done", DONE_TIMEOUT)
        role.wait(30)
        stats = _stats_lines(role)
        assert stats, f"{name}: no stats line; stderr tail:\n{role.stderr_tail()}"
        return done, stats[-1]


@pytest.fixture(scope="module")
def written():
    """A master and a node as processes, and engine A's pages in them. The node's TTL is long
    so that the master keeps listing pages of a node that died (the failure test needs
    lookups that hit and loads that then fail)."""
    log_dir = harness.WORK_DIR / "logs" / f"sglang_hicache_e2e-{LAYOUT}"
    model = str(harness.tiny_llama())
    with harness.KvbridgeDaemons(log_dir, nodes=1, dram_bytes="256M",
                                 node_ttl_ms=30000) as daemons:
        prompts = harness.prompts(2, 110, -28)
        cfg = {"master": daemons.address, "model": model, "layout": LAYOUT,
               "prompts": prompts, "wait_for_backup": True}
        a, a_stats = _run("engine-a", cfg, log_dir)
        assert all(not (o["details"] or {}).get("storage") for o in a["outputs"]), a
        assert a_stats["set_ok_pages"] > 0 and a_stats["set_failed_pages"] == 0, a_stats
        status = daemons.status()
        assert status["objects"] > 0 and status["stored_bytes"] > 0, status
        yield {"daemons": daemons, "a": a, "a_stats": a_stats, "status": status,
               "log_dir": log_dir, "base": {k: cfg[k] for k in ("master", "model", "layout",
                                                                "prompts")}}


def test_fresh_engine_loads_prompt_pages_from_kvbridge(written):
    b, b_stats = _run("engine-b", dict(written["base"]), written["log_dir"])
    a, status = written["a"], written["status"]
    for oa, ob in zip(a["outputs"], b["outputs"]):
        assert ob["ids"] == oa["ids"]
        storage = (ob["details"] or {}).get("storage", 0)
        assert storage > 0 and storage % PAGE == 0, ob
        assert ob["details"]["storage_backend"] == "KvbridgeHiCacheStorage"
    loaded = sum(o["details"]["storage"] for o in b["outputs"])
    # The bytes came through kvbridge: B's backend read every loaded page from the store,
    # pages of the size the master holds them at (one object per page in this layout).
    assert b_stats["get_hit_pages"] * PAGE >= loaded, b_stats
    page_bytes = status["stored_bytes"] // status["objects"]
    assert b_stats["get_bytes"] == b_stats["get_hit_pages"] * page_bytes, (b_stats, status)
    assert b_stats["errors"] == 0 and b_stats["get_miss_pages"] == 0, b_stats


def test_storage_node_killed_during_a_load_means_recompute_and_same_ids(written, tmp_path):
    """B first runs a prompt of its own, whose pages it backs up (so its client is connected
    to the node). Then the node is frozen (SIGSTOP) and B gets A's prompts: its first load
    blocks in the node's transfer; once B's lookups have hit, the node is killed (SIGKILL)
    under that load. B must fail the load, recompute, and answer with A's ids. Runs after
    the test above: it kills the node that holds A's pages."""
    daemons = written["daemons"]
    node = daemons.nodes[0]
    # A progress timeout far above the kill's time: the load ends because the node died.
    cfg = {**written["base"], "go_file": str(tmp_path / "go"),
           "warmup_prompt": harness.prompts(3, 110, -28)[2],
           "extra": {"progress_timeout_ms": 20000, "transfer_deadline_ms": 30000}}
    timeline = {}

    def freeze_go_kill(role):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:  # the warm-up prompt's pages are in the store
            if any(s["set_ok_pages"] > 0 for s in _stats_lines(role)):
                break
            time.sleep(0.05)
        node.signal_group(signal.SIGSTOP)
        open(cfg["go_file"], "w").close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:  # until B's lookups found the pages
            if any(s["exists_hit_pages"] > 0 for s in _stats_lines(role)):
                break
            time.sleep(0.05)
        timeline["lookup_s"] = time.monotonic() - t0
        time.sleep(2.5)  # B's prefetch thread is now in its first get, blocked on the node
        node.signal_group(signal.SIGKILL)
        timeline["killed_at_s"] = time.monotonic() - t0

    b, b_stats = _run("engine-b-node-killed", cfg, written["log_dir"], before_go=freeze_go_kill)
    for oa, ob in zip(written["a"]["outputs"], b["outputs"]):
        assert ob["ids"] == oa["ids"]
        assert not (ob["details"] or {}).get("storage"), ob
    assert b_stats["exists_hit_pages"] > 0, b_stats  # the lookups found the pages ...
    assert b_stats["get_hit_pages"] == 0 and b_stats["get_miss_pages"] > 0, b_stats  # ... lost
    assert b_stats["errors"] > 0, b_stats
    # The first get was in flight when the node died (blocked about the 2.5 s above), and it
    # ended with the kill, not with the 20 s progress timeout.
    assert 1.5 <= b_stats["get_max_seconds"] < 10, (b_stats, timeline)
    assert b["gen_s"] < 30, (b, timeline)
