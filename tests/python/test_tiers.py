"""The SSD tier from Python: an embedded cluster whose nodes have an SSD tier (the ssd plugin,
real files under a temporary directory), DRAM pressure, gets served from SSD."""

from __future__ import annotations

import time

import pytest
import torch

import kvbridge
from kvbridge import errors


def _cluster(tmp_path, **kw):
    try:
        return kvbridge.Cluster(nodes=2, dram_bytes_per_node=8 << 20, ssd_dir=str(tmp_path),
                                ssd_bytes_per_node=64 << 20, node_ttl_ms=2000, lease_ms=1000,
                                **kw)
    except errors.UnavailableError as e:
        if "ssd" in str(e):
            pytest.skip(f"the ssd storage plugin is not available: {e}")
        raise


def test_pressure_demotes_to_ssd_and_everything_reads_back(tmp_path):
    with _cluster(tmp_path) as cluster:
        store = cluster.client()
        pages = torch.empty(120, 128 * 1024, dtype=torch.uint8)
        for i in range(120):
            pages[i].fill_(i)
        store.register_buffer(pages)
        for first in range(0, 120, 8):
            keys = [f"tier/{i}" for i in range(first, first + 8)]
            assert all(s.ok for s in store.batch_put_from(keys, list(pages[first:first + 8])))
            time.sleep(0.3)  # demotion keeps up at this pace
        deadline = time.monotonic() + 10
        st = cluster.status()
        while time.monotonic() < deadline and st["ssd_replicas"] == 0:
            time.sleep(0.2)
            st = cluster.status()
        assert st["objects"] == 120 and st["evictions_total"] == 0
        assert st["ssd_replicas"] > 0 and st["demotions_total"] >= st["ssd_replicas"]
        assert all(n["ssd_capacity_bytes"] == 64 << 20 for n in st["nodes"])
        # Where each object is (no read, no access: nothing is promoted by asking). Demotion
        # may go on meanwhile, so the SSD count lies between the two status reads.
        reps = store.batch_replicas([f"tier/{i}" for i in range(120)])
        after = cluster.status()["ssd_replicas"]
        assert all(r.ok and len(r.replicas) == 1 for r in reps)
        tiers = [r.replicas[0].tier for r in reps]
        assert st["ssd_replicas"] <= tiers.count("SSD") <= after
        assert tiers.count("SSD") + tiers.count("DRAM") == 120
        assert all(r.replicas[0].size == 128 * 1024 for r in reps)
        # The Mooncake layer shows an SSD replica as a local-disk one (vLLM's tier logging).
        from kvbridge.compat.mooncake import ReplicaDescriptor
        on_ssd = ReplicaDescriptor(next(r.replicas[0] for r in reps
                                        if r.replicas[0].tier == "SSD"))
        assert on_ssd.is_local_disk_replica() and not on_ssd.is_memory_replica()
        with pytest.raises(RuntimeError, match="Expected MemoryDescriptor"):
            on_ssd.get_memory_descriptor()
        out = torch.zeros(128 * 1024, dtype=torch.uint8)
        for i in range(120):
            assert store.get_into(f"tier/{i}", out) == 128 * 1024
            assert bool((out == i).all()), i
