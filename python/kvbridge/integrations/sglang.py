"""SGLang HiCache L3 storage backend over the kvbridge store (docs/sglang.md).

SGLang loads it by configuration only, through its ``dynamic`` storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvbridge",
        "module_path": "kvbridge.integrations.sglang",
        "class_name": "KvbridgeHiCacheStorage", "interface_v1": 1,
        "master": "10.0.0.1:50051"}'

SGLang builds the class as ``KvbridgeHiCacheStorage(storage_config, kwargs)`` and hands it the
host KV pool afterwards (``register_mem_pool_host``). The pool's buffers are registered with
the store once; with ``"interface_v1": 1`` pages then move between the host pool and the
storage nodes with no copy in this process (``batch_set_v1`` / ``batch_get_v1``). Without it
SGLang uses the generic ``batch_set`` / ``batch_get`` interface on flat page tensors.

Nothing here raises into SGLang's cache controller once the backend is built: a master or a
storage node that is dead, frozen or restarted makes a page a miss (SGLang recomputes it),
within the store's deadlines. Bad settings are refused at construction, naming the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

import kvbridge
from kvbridge.errors import AlreadyExistsError, KvbError
from kvbridge.store import client_stats_summary

logger = logging.getLogger(__name__)

__all__ = ["KvbridgeHiCacheStorage", "parse_settings", "MAX_BUFFERS_PER_OBJECT"]

# A store object holds at most this many buffers (the master's limit, docs/store.md
# "Objects"); a page with more buffers (layer_first keeps one K and one V buffer per layer) is
# stored as several objects.
MAX_BUFFERS_PER_OBJECT = 16

# Keys SGLang itself reads from the extra config (the controller pops some of them before the
# backend sees the dict, the dynamic factory reads others): accepted, not used here.
SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
)

# The backend's own keys: name -> (kind, default). Kinds are checked by _check().
SETTINGS: Dict[str, Tuple[str, Any]] = {
    "master": ("address", None),  # "host:port" of an external kvbridge master
    "embedded": ("embedded", None),  # a master + nodes in this process (one host)
    "replica_num": ("int>=1", 1),
    "namespace": ("name", "sglang"),
    "model_name": ("str", None),  # default: SGLang's model name
    "rpc_timeout_ms": ("int>=1", None),  # None: kvbridge's (KVBRIDGE_*, else its default)
    "transfer_deadline_ms": ("int>=1", None),
    "progress_timeout_ms": ("int>=1", None),
    "hedge_after_ms": ("int>=0", None),
    "verify_checksums": ("bool", None),
    "cluster_token": ("str", None),
    "listen": ("str", None),
    "transports": ("str", None),
    "log_stats_interval_s": ("number>=0", 0),
}

EMBEDDED_SETTINGS: Dict[str, Tuple[str, Any]] = {
    "nodes": ("int>=1", 1),
    "dram_bytes_per_node": ("size", 1 << 30),
    "ssd_dir": ("str", ""),
    "ssd_bytes_per_node": ("size", 1 << 30),
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _bad(key: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"kvbridge HiCache backend: extra_config {key}={value!r}: expected "
                      f"{expected}")


def _check(key: str, value: Any, kind: str) -> Any:
    """value converted to what `kind` says, or a ValueError naming the key."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind.startswith("int>="):
        minimum = int(kind[5:])
        if not is_int or value < minimum:
            raise _bad(key, value, f"an integer >= {minimum}")
        return value
    if kind == "number>=0":
        if not (is_int or isinstance(value, float)) or value < 0:
            raise _bad(key, value, "a number >= 0")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _bad(key, value, "true or false")
        return value
    if kind in ("str", "name"):
        if not isinstance(value, str):
            raise _bad(key, value, "a string")
        if kind == "name" and (not value or "/" in value):
            raise _bad(key, value, "a non-empty string without '/'")
        return value
    if kind == "address":
        if not isinstance(value, str) or not re.match(r"^\S+:\d+$", value):
            raise _bad(key, value, "\"host:port\"")
        return value
    if kind == "size":
        if is_int and value > 0:
            return value
        m = _SIZE_RE.match(value) if isinstance(value, str) else None
        if m is None or float(m.group(1)) <= 0:
            raise _bad(key, value, "a positive byte count (an integer, or a string such as "
                                   "\"512MiB\", \"4G\")")
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if kind == "embedded":
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise _bad(key, value, "an object such as {\"nodes\": 1, "
                                   "\"dram_bytes_per_node\": \"1GiB\"}, or true")
        out = {}
        for k, v in value.items():
            if k not in EMBEDDED_SETTINGS:
                raise ValueError(
                    f"kvbridge HiCache backend: unknown key {k!r} in extra_config embedded; "
                    f"accepted keys: {', '.join(EMBEDDED_SETTINGS)}")
            out[k] = _check(f"embedded.{k}", v, EMBEDDED_SETTINGS[k][0])
        return {k: out.get(k, d) for k, (_, d) in EMBEDDED_SETTINGS.items()}
    raise AssertionError(kind)


def parse_settings(extra_config: Optional[dict]) -> Dict[str, Any]:
    """The backend's settings from SGLang's extra config, defaults filled in. ValueError for
    an unknown or ill-typed key (naming it and the accepted keys), or for contradictory
    settings."""
    if extra_config is None:
        extra_config = {}
    if not isinstance(extra_config, dict):
        raise ValueError(f"kvbridge HiCache backend: extra_config must be a JSON object, got "
                         f"{type(extra_config).__name__}")
    out = {k: d for k, (_, d) in SETTINGS.items()}
    for key, value in extra_config.items():
        if key in SGLANG_KEYS:
            continue
        if key not in SETTINGS:
            raise ValueError(
                f"kvbridge HiCache backend: unknown extra_config key {key!r}; accepted keys: "
                f"{', '.join(SETTINGS)} (and SGLang's own: {', '.join(SGLANG_KEYS)})")
        out[key] = None if value is None else _check(key, value, SETTINGS[key][0])
    if out["master"] is not None and out["embedded"] is not None:
        raise ValueError("kvbridge HiCache backend: extra_config has both 'master' and "
                         "'embedded'; give one (an external master, or a cluster in this "
                         "process)")
    return out


class _Stats:
    """Counters of one backend (cumulative) and the per-call samples SGLang's storage metrics
    take (drained by get_stats)."""

    SAMPLES_MAX = 4096

    def __init__(self, keep_samples: bool):
        self.lock = threading.Lock()
        self.keep_samples = keep_samples
        self.c: Dict[str, Any] = {
            "get_calls": 0, "get_pages": 0, "get_hit_pages": 0, "get_miss_pages": 0,
            "get_bytes": 0, "get_seconds": 0.0, "get_max_seconds": 0.0,
            "set_calls": 0, "set_pages": 0, "set_ok_pages": 0, "set_failed_pages": 0,
            "set_bytes": 0, "set_seconds": 0.0, "set_max_seconds": 0.0,
            "exists_calls": 0, "exists_pages": 0, "exists_hit_pages": 0,
            "exists_seconds": 0.0, "exists_max_seconds": 0.0,
            "errors": 0,
        }
        self.last_error = ""
        self.prefetch_pgs: List[int] = []
        self.backup_pgs: List[int] = []
        self.prefetch_bandwidth: List[float] = []
        self.backup_bandwidth: List[float] = []

    def _call(self, op: str, seconds: float) -> None:
        c = self.c
        c[f"{op}_calls"] += 1
        c[f"{op}_seconds"] += seconds
        if seconds > c[f"{op}_max_seconds"]:
            c[f"{op}_max_seconds"] = seconds

    def _pages(self, op: str, done_name: str, undone_name: str, pages: int, done: int,
               page_bytes: int, seconds: float, pgs: List[int], bandwidth: List[float]) -> None:
        with self.lock:
            self._call(op, seconds)
            c = self.c
            c[f"{op}_pages"] += pages
            c[done_name] += done
            c[undone_name] += pages - done
            c[f"{op}_bytes"] += done * page_bytes
            if self.keep_samples and done and len(pgs) < self.SAMPLES_MAX:
                pgs.append(done)
                bandwidth.append(done * page_bytes / max(seconds, 1e-9) / 1e9)

    def get(self, pages: int, hits: int, page_bytes: int, seconds: float) -> None:
        self._pages("get", "get_hit_pages", "get_miss_pages", pages, hits, page_bytes, seconds,
                    self.prefetch_pgs, self.prefetch_bandwidth)

    def set(self, pages: int, ok: int, page_bytes: int, seconds: float) -> None:
        self._pages("set", "set_ok_pages", "set_failed_pages", pages, ok, page_bytes, seconds,
                    self.backup_pgs, self.backup_bandwidth)

    def exists(self, pages: int, hits: int, seconds: float) -> None:
        with self.lock:
            self._call("exists", seconds)
            self.c["exists_pages"] += pages
            self.c["exists_hit_pages"] += hits

    def error(self, what: str) -> None:
        with self.lock:
            self.c["errors"] += 1
            self.last_error = what

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            out = dict(self.c)
            out["last_error"] = self.last_error
        for op in ("get", "set", "exists"):
            calls = out[f"{op}_calls"]
            out[f"{op}_mean_seconds"] = out[f"{op}_seconds"] / calls if calls else 0.0
        return out

    def drain_samples(self) -> Tuple[list, list, list, list]:
        with self.lock:
            got = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth,
                   self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs = [], []
            self.prefetch_bandwidth, self.backup_bandwidth = [], []
        return got


def _storage_ranges(pool: Any) -> List[Tuple[int, int]]:
    """(start, end) of the memory behind the host pool's tensors, overlaps merged: the whole
    allocation of each tensor (its storage), so views such as k_buffer = kv_buffer[0] count
    once."""
    tensors = []

    def add(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                add(o)

    add(getattr(pool, "kv_buffer", None))
    if hasattr(pool, "get_hybrid_pool_buffer"):
        try:
            add(pool.get_hybrid_pool_buffer())
        except Exception:  # optional: only some pools have more buffers than kv_buffer
            pass
    for name in ("k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        try:
            add(getattr(pool, name, None))
        except Exception:
            pass
    spans = []
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if start and size:
            spans.append((start, start + size))
    spans.sort()
    merged: List[Tuple[int, int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


class KvbridgeHiCacheStorage(HiCacheStorage):
    """SGLang's HiCache L3 storage on the kvbridge store (docs/sglang.md).

    Keys: ``<namespace>/<model>/<shard>/<format>/<page hash>/<object>``, where shard is
    ``tp<r>of<n>`` (MHA; ``mla`` for MLA, whose pages every rank shares) plus ``-pp<r>of<n>``,
    ``-cp<r>of<n>``, ``-dcp<r>of<n>`` where those are used, format names the host layout,
    dtype, page size and buffers per page (so a page written in another byte order misses
    instead of loading), and object is 0, 1, ... for the zero-copy interface (a page's buffers
    in groups of at most 16 per object) or ``flat`` for the generic one.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        if kwargs:
            extra.update(kwargs)
        self.settings = parse_settings(extra)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        s = self.settings
        self.is_mla = bool(storage_config.is_mla_model)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = (not self.is_mla or storage_config.tp_rank == 0) if writer is None \
            else bool(writer)
        if s["master"] is None and s["embedded"] is None:
            raise ValueError("kvbridge HiCache backend: extra_config needs 'master' "
                             "(\"host:port\" of a kvbridge master) or 'embedded' (a master and "
                             "nodes in this process, e.g. {\"nodes\": 1, "
                             "\"dram_bytes_per_node\": \"4GiB\"})")
        if s["embedded"] is not None and self.is_mla and storage_config.tp_size > 1:
            raise ValueError(
                "kvbridge HiCache backend: 'embedded' keeps pages in this process only, but an "
                "MLA model's pages are written by rank 0 and read by every rank; start a "
                "kvbridge master and nodes and give 'master' instead")

        model = (s["model_name"] or storage_config.model_name or "model").replace("/", "-")
        self.key_root = f"{s['namespace']}/{model.strip('-') or 'model'}/{self._shard_tag()}/"
        self.prefix: Optional[str] = None  # key_root + format + "/", set with the host pool
        self._stats = _Stats(bool(getattr(storage_config, "enable_storage_metrics", False)))
        self._store_stats: Dict[str, int] = {}  # the store client's, as last read (stats())
        self._closed = False
        self._close_lock = threading.Lock()
        self._registered: List[Tuple[int, int]] = []
        self._last_stats_log = time.monotonic()
        self._last_warn: Dict[str, float] = {}

        opts: Dict[str, Any] = {"replica_num": s["replica_num"]}
        for key, option in (("rpc_timeout_ms", "rpc_timeout_ms"),
                            ("transfer_deadline_ms", "store_transfer_deadline_ms"),
                            ("progress_timeout_ms", "progress_timeout_ms"),
                            ("hedge_after_ms", "hedge_after_ms"),
                            ("verify_checksums", "verify_checksums"),
                            ("cluster_token", "cluster_token"), ("listen", "listen"),
                            ("transports", "transports")):
            if s[key] is not None:
                opts[option] = s[key]
        self._cluster: Optional[kvbridge.Cluster] = None
        try:
            if s["embedded"] is not None:
                e = s["embedded"]
                engine_opts = {k: opts[k] for k in ("progress_timeout_ms", "cluster_token",
                                                    "transports") if k in opts}
                self._cluster = kvbridge.Cluster(
                    nodes=e["nodes"], dram_bytes_per_node=e["dram_bytes_per_node"],
                    replica_num=s["replica_num"], ssd_dir=e["ssd_dir"],
                    ssd_bytes_per_node=e["ssd_bytes_per_node"],
                    node_id_prefix=f"hicache-{self._shard_tag()}", **engine_opts)
                self.master = self._cluster.master_address
            else:
                self.master = s["master"]
            self._store = kvbridge.StoreClient(master=self.master, **opts)
        except Exception:
            if self._cluster is not None:
                self._cluster.close()
            raise
        logger.info("kvbridge HiCache backend: master %s (%s), keys %s..., interface %s, "
                    "writer %s", self.master, "embedded" if self._cluster else "external",
                    self.key_root, "v1 (zero-copy)" if self.interface_v1 else "generic",
                    self.is_writer)

    # -- keys ------------------------------------------------------------------------------
    def _shard_tag(self) -> str:
        c = self.storage_config
        parts = ["mla" if self.is_mla else f"tp{c.tp_rank}of{c.tp_size}"]
        if c.pp_size > 1:
            parts.append(f"pp{c.pp_rank}of{c.pp_size}")
        if getattr(c, "attn_cp_size", 1) > 1:
            parts.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
        if getattr(c, "dcp_size", 1) > 1:
            parts.append(f"dcp{c.dcp_rank}of{c.dcp_size}")
        return "-".join(parts)

    def object_keys(self, keys: Sequence[str]) -> List[str]:
        """The store keys of the pages `keys` in the configured interface's form (for
        tests and tools; needs the host pool)."""
        if self.prefix is None:
            raise RuntimeError("kvbridge HiCache backend: no host pool registered yet")
        p = self.prefix
        if not self.interface_v1:
            return [f"{p}{k}/flat" for k in keys]
        objs = range(len(self._obj_slices))
        return [f"{p}{k}/{j}" for k in keys for j in objs]

    # -- host pool -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learns the pool's page format (buffers per page, their sizes) and registers its
        memory with the store once. Raises if the pool cannot be served (SGLang then fails the
        attach with this message)."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        page = getattr(pool, "logical_page_size", None) or pool.page_size
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
        except Exception as e:
            raise ValueError(f"kvbridge HiCache backend: host pool {type(pool).__name__} "
                             f"(layout {getattr(pool, 'layout', '?')}) gives no page buffer "
                             f"metadata: {e}") from e
        nbuf = len(ptrs)
        if nbuf == 0:
            raise ValueError(f"kvbridge HiCache backend: host pool {type(pool).__name__} has "
                             "no buffers per page")
        self._bufs_per_page = nbuf
        self._obj_slices = [(a, min(a + MAX_BUFFERS_PER_OBJECT, nbuf))
                            for a in range(0, nbuf, MAX_BUFFERS_PER_OBJECT)]
        self._obj_bytes = [sum(sizes[a:b]) for a, b in self._obj_slices]
        self.page_bytes = sum(sizes)
        if all(x == sizes[0] for x in sizes):
            shape = f"{nbuf}x{sizes[0]}"
        else:
            shape = f"{nbuf}b" + hashlib.sha1(",".join(map(str, sizes)).encode()).hexdigest()[:10]
        dtype = str(getattr(pool, "dtype", "")).replace("torch.", "")
        self.format_tag = f"{pool.layout}-{dtype}-p{page}-{shape}"
        self.prefix = f"{self.key_root}{self.format_tag}/"

        ranges = _storage_ranges(pool)
        last = (pool.size // pool.page_size - 1) * page if getattr(pool, "size", 0) else 0
        for probe in {0, max(0, last)}:
            pp, ss = pool.get_page_buffer_meta(torch.arange(probe, probe + page))
            for p, n in zip(pp, ss):
                if not any(s <= p and p + n <= e for s, e in ranges):
                    raise ValueError(
                        f"kvbridge HiCache backend: host pool {type(pool).__name__} page buffer "
                        f"{p:#x}+{n} lies outside the pool's tensors; cannot register it")
        for s, e in ranges:
            try:
                self._store.register_buffer((s, e - s))
            except AlreadyExistsError:
                continue
            self._registered.append((s, e - s))
        logger.info("kvbridge HiCache backend: host pool %s layout %s, %d buffer(s) per page "
                    "in %d object(s), %d bytes per page, %d range(s) registered (%d bytes)",
                    type(pool).__name__, pool.layout, nbuf, len(self._obj_slices),
                    self.page_bytes, len(self._registered), sum(n for _, n in self._registered))

    def on_host_pools_registered(self) -> None:
        pools = getattr(self, "registered_pools", {}) or {}
        other = [str(n) for n, p in pools.items()
                 if p is not getattr(self, "mem_pool_host", None) and str(n) != "kv"]
        if other:
            raise NotImplementedError(
                f"kvbridge HiCache backend: host pools {', '.join(other)} (hybrid models: "
                "Mamba, SWA, indexer, ...) are not supported; only the KV pool is")

    # -- helpers ---------------------------------------------------------------------------
    def _usable(self) -> bool:
        return not self._closed and self.prefix is not None

    def _warn(self, what: str, err: BaseException | str) -> None:
        """Logs a failure turned into a miss, at most once per 5 s per kind."""
        msg = f"{what}: {err}"
        self._stats.error(msg)
        now = time.monotonic()
        if now - self._last_warn.get(what, -1e9) >= 5.0:
            self._last_warn[what] = now
            logger.warning("kvbridge HiCache backend: %s (counted as a miss)", msg)

    def _maybe_log_stats(self) -> None:
        interval = self.settings["log_stats_interval_s"]
        if interval and time.monotonic() - self._last_stats_log >= interval:
            self._last_stats_log = time.monotonic()
            logger.info("kvbridge HiCache stats %s", json.dumps(self.stats(), sort_keys=True))

    def _plan(self, keys: Sequence[str], host_indices: torch.Tensor
              ) -> Tuple[List[str], List[List[int]], List[List[int]]]:
        """Store keys, addresses and lengths (one list per object) for the pages `keys` at
        `host_indices` of the host pool."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        nb = self._bufs_per_page
        if len(ptrs) != len(keys) * nb:
            raise ValueError(f"{len(keys)} keys but {len(ptrs)} page buffers for "
                             f"{host_indices.numel()} host slots ({nb} per page expected)")
        p = self.prefix
        okeys: List[str] = []
        addrs: List[List[int]] = []
        lens: List[List[int]] = []
        slices = self._obj_slices
        for i, key in enumerate(keys):
            base = i * nb
            for j, (a, b) in enumerate(slices):
                okeys.append(f"{p}{key}/{j}")
                addrs.append(ptrs[base + a:base + b])
                lens.append(sizes[base + a:base + b])
        return okeys, addrs, lens

    def _page_flags(self, okeys: List[str], pages: int) -> List[bool]:
        flags = self._store.batch_exists(okeys)
        m = len(okeys) // pages if pages else 1
        return [all(flags[i * m:(i + 1) * m]) for i in range(pages)]

    # -- zero-copy interface ---------------------------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Reads the pages into the host pool at host_indices; one bool per page (False: not
        read, whatever the reason; its host slots then hold no defined bytes)."""
        n = len(keys)
        if n == 0:
            return []
        if not self._usable():
            return [False] * n
        t0 = time.perf_counter()
        try:
            okeys, addrs, lens = self._plan(keys, host_indices)
            got, failed = self._store.batch_get_into_ptrs(okeys, addrs, lens)
        except Exception as e:  # master gone, closed, ...: every page is a miss
            self._warn("batch_get_v1", e)
            self._stats.get(n, 0, self.page_bytes, time.perf_counter() - t0)
            return [False] * n
        m = len(self._obj_slices)
        expect = self._obj_bytes
        result = []
        for i in range(n):
            ok = True
            for j in range(m):
                k = i * m + j
                if k in failed or got[k] != expect[j]:
                    ok = False
                    break
            result.append(ok)
        hits = sum(result)
        if failed:
            first = failed[min(failed)]
            self._warn("batch_get_v1", f"{len(failed)} of {len(okeys)} objects not read, e.g. "
                                       f"{first.name} ({first.message})")
        self._stats.get(n, hits, self.page_bytes, time.perf_counter() - t0)
        self._maybe_log_stats()
        return result

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Stores the pages from the host pool at host_indices; one bool per page. A page the
        store has already counts as stored (it is not written again). A rank that is not its
        model's storage writer (MLA ranks other than 0) writes nothing and reports which
        pages the store has."""
        n = len(keys)
        if n == 0:
            return []
        if not self._usable():
            return [False] * n
        t0 = time.perf_counter()
        try:
            okeys, addrs, lens = self._plan(keys, host_indices)
            if not self.is_writer:
                return self._page_flags(okeys, n)
            failed = self._store.batch_put_from_ptrs(okeys, addrs, lens)
        except Exception as e:
            self._warn("batch_set_v1", e)
            self._stats.set(n, 0, self.page_bytes, time.perf_counter() - t0)
            return [False] * n
        m = len(self._obj_slices)
        if failed:
            bad = {k // m for k in failed}
            result = [i not in bad for i in range(n)]
            first = failed[min(failed)]
            self._warn("batch_set_v1", f"{len(failed)} of {len(okeys)} objects not stored, "
                                       f"e.g. {first.name} ({first.message})")
        else:
            result = [True] * n
        self._stats.set(n, sum(result), self.page_bytes, time.perf_counter() - t0)
        self._maybe_log_stats()
        return result

    # -- existence -------------------------------------------------------------------------
    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many pages from the start of `keys` the store has (every object of each)."""
        n = len(keys)
        if n == 0 or not self._usable():
            return 0
        t0 = time.perf_counter()
        try:
            flags = self._page_flags(self.object_keys(keys), n)
        except Exception as e:
            self._warn("batch_exists", e)
            self._stats.exists(n, 0, time.perf_counter() - t0)
            return 0
        hits = flags.index(False) if False in flags else n
        self._stats.exists(n, hits, time.perf_counter() - t0)
        self._maybe_log_stats()
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- generic interface (flat page tensors; one staging copy each way) ------------------
    def _flat_key(self, key: str) -> str:
        return f"{self.prefix}{key}/flat"

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """The page `key` read into target_location (a CPU tensor, or an address with
        target_sizes bytes), returned; with no target a new uint8 tensor. None on a miss,
        including an object whose size is not the target's."""
        if not self._usable():
            return None
        t0 = time.perf_counter()
        try:
            fkey = self._flat_key(key)
            if target_location is None:
                data = self._store.get(fkey)
                out: Any = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                n = len(data)
                want = n
            elif isinstance(target_location, torch.Tensor):
                out = target_location
                want = target_location.numel() * target_location.element_size()
                n = self._store.get_into(fkey, target_location)
            else:
                out = target_location
                want = int(target_sizes)
                n = self._store.get_into(fkey, (int(target_location), want))
        except KeyError:  # NotFoundError: a plain miss
            self._stats.get(1, 0, 0, time.perf_counter() - t0)
            return None
        except Exception as e:
            self._warn("get", e)
            self._stats.get(1, 0, 0, time.perf_counter() - t0)
            return None
        if n != want:
            self._warn("get", f"object {fkey!r} has {n} bytes, the target {want}")
            self._stats.get(1, 0, 0, time.perf_counter() - t0)
            return None
        self._stats.get(1, 1, n, time.perf_counter() - t0)
        return out

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        sizes = target_sizes if target_sizes is not None else [None] * len(keys)
        out = [self.get(k, t, s) for k, t, s in zip(keys, targets, sizes)]
        self._maybe_log_stats()
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Stores a flat page (a tensor, or target_location/target_sizes as an address and a
        length). True when stored or already there."""
        if not self._usable():
            return False
        if not self.is_writer:
            return self.exists(key)
        t0 = time.perf_counter()
        try:
            if value is not None:
                buf = value if value.is_contiguous() else value.contiguous()
                nbytes = buf.numel() * buf.element_size()
            else:
                buf = (int(target_location), int(target_sizes))
                nbytes = buf[1]
            self._store.put(self._flat_key(key), buf)
        except Exception as e:
            self._warn("set", e)
            self._stats.set(1, 0, 0, time.perf_counter() - t0)
            return False
        self._stats.set(1, 1, nbytes, time.perf_counter() - t0)
        return True

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """True only if every page was stored; stops at the first failure."""
        n = len(keys)
        vals = values if values is not None else [None] * n
        locs = target_locations if target_locations is not None else [None] * n
        sizes = target_sizes if target_sizes is not None else [None] * n
        ok = all(self.set(k, v, t, s) for k, v, t, s in zip(keys, vals, locs, sizes))
        self._maybe_log_stats()
        return ok

    # -- the rest --------------------------------------------------------------------------
    def clear(self) -> bool:
        """Removes every object of the store (as SGLang's Mooncake backend does: the store
        has no removal by prefix, so other models' pages on the same master go too)."""
        if self._closed:
            return False
        try:
            self._store.remove_all()
            return True
        except Exception as e:
            self._warn("clear", e)
            return False

    def stats(self) -> Dict[str, Any]:
        """Cumulative counters: pages asked for, hit, missed, bytes, seconds per operation,
        errors turned into misses (and the last one); and the store client's own
        (``store_client_*``, kvbridge.store.client_stats_summary: keys hit, of which from
        SSD, missed, bytes, failed keys, calls and their time), with its hit rate and mean
        seconds per call. After close() the store client's last counters stand."""
        out = self._stats.snapshot()
        out.update(master=getattr(self, "master", ""), format=getattr(self, "format_tag", ""),
                   interface="v1" if self.interface_v1 else "generic")
        store = getattr(self, "_store", None)
        if store is not None:
            try:
                self._store_stats = client_stats_summary(store.stats())
            except KvbError:  # closed
                pass
        c = self._store_stats
        out.update(c)
        asked = c.get("store_client_get_keys", 0)
        out["store_client_hit_rate"] = c.get("store_client_get_hits", 0) / asked if asked else 0.0
        for op in ("get", "put", "exists"):
            calls = c.get(f"store_client_{op}_calls", 0)
            out[f"store_client_{op}_mean_seconds"] = \
                c.get(f"store_client_{op}_us", 0) / calls / 1e6 if calls else 0.0
        return out

    def get_stats(self):
        """SGLang's StorageMetrics (pages and GB/s per get and set since the last call, as
        its collector expects), with the cumulative counters of stats() as `.kvbridge`."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        pre, back, pre_bw, back_bw = self._stats.drain_samples()
        m.prefetch_pgs.extend(pre)
        m.backup_pgs.extend(back)
        m.prefetch_bandwidth.extend(pre_bw)
        m.backup_bandwidth.extend(back_bw)
        m.kvbridge = self.stats()
        return m

    def close(self) -> None:
        """Unregisters the host pool and closes the store client (and an embedded cluster).
        Later calls are misses. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.settings["log_stats_interval_s"]:
            logger.info("kvbridge HiCache stats %s", json.dumps(self.stats(), sort_keys=True))
        for s, n in self._registered:
            try:
                self._store.unregister_buffer((s, n))
            except Exception:
                pass
        self._registered = []
        try:
            self._store.close()
        finally:
            if self._cluster is not None:
                self._cluster.close()
