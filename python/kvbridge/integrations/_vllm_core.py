"""The parts of the vLLM connector that do not import vLLM (kvbridge.integrations.vllm).

Settings from ``kv_connector_extra_config``, the request parameters of prefill/decode
disaggregation, the content keys of the shared prefix store, block-run merging, the layout of
the KV tensors vLLM registers, and the per-connector counters. Everything here is plain Python
over kvbridge, so it is tested without an engine (tests/engines/test_vllm_connector.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from kvbridge.errors import InvalidArgumentError

# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------

_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_DEVICE_KV = ("auto", "direct", "stage")


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` of KvbridgeConnector, checked (docs/vllm.md lists each).

    Unknown keys and values of the wrong type raise InvalidArgumentError naming the key, so a
    typo never silently turns a feature off."""

    # Shared prefix store (off while master is "").
    master: str = ""
    replica_num: int = 1
    store_rpc_timeout_ms: int = 0  # 0: kvbridge's default
    store_transfer_deadline_ms: int = 0  # 0: kvbridge's default
    store_save: Optional[bool] = None  # None: kv_role is kv_producer or kv_both
    store_load: Optional[bool] = None  # None: kv_role is kv_consumer or kv_both
    model_tag: str = ""  # "": derived from the model, dtype and KV geometry
    # Prefill/decode disaggregation.
    host: str = ""  # "": vLLM's get_ip() (VLLM_HOST_IP)
    side_channel_port: int = 0  # 0: any free port (published through vLLM's handshake metadata)
    handshake_timeout_ms: int = 3000
    transfer_deadline_ms: int = 10000
    progress_timeout_ms: int = 2000
    hold_timeout_s: float = 60.0
    load_threads: int = 2
    # Both.
    stage_through_host: bool = False  # move KV through host pages even when it is host memory
    # GPU KV: "auto" registers it as device memory where kvbridge can (a CUDA driver; a
    # transport and store that take device memory), else stages it; "direct" requires the
    # former; "stage" always stages.
    device_kv: str = "auto"
    staging_bytes: int = 256 << 20  # pinned host pages for staged KV (GPU)
    cluster_token: str = ""
    transports: str = ""  # "": every transport the build has
    stats_file: str = ""

    @classmethod
    def from_extra(cls, extra: Optional[dict], kv_role: Optional[str]) -> "Settings":
        extra = dict(extra or {})
        if kv_role not in _ROLES:
            raise InvalidArgumentError(
                f"kv_role {kv_role!r}: KvbridgeConnector needs one of {', '.join(_ROLES)}")
        known = {f.name: f for f in cls.__dataclass_fields__.values()}  # type: ignore[attr-defined]
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise InvalidArgumentError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"KvbridgeConnector knows: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            values[name] = _typed(name, value, default)
        s = cls(**values)
        s._check()
        return s

    def _check(self) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidArgumentError(
                f"kv_connector_extra_config[{name!r}] = {getattr(self, name)!r}: {why}")

        if self.master and (":" not in self.master or not self.master.rsplit(":", 1)[1].isdigit()):
            bad("master", "expected 'host:port' of a kvbridge master")
        if self.replica_num < 1:
            bad("replica_num", "must be at least 1")
        for name in ("handshake_timeout_ms", "transfer_deadline_ms", "progress_timeout_ms"):
            if getattr(self, name) <= 0:
                bad(name, "must be positive")
        if self.hold_timeout_s <= 0:
            bad("hold_timeout_s", "must be positive")
        if self.staging_bytes <= 0:
            bad("staging_bytes", "must be positive")
        if self.device_kv not in _DEVICE_KV:
            bad("device_kv", f"must be one of {', '.join(_DEVICE_KV)}")
        if self.load_threads < 1:
            bad("load_threads", "must be at least 1")
        if not 0 <= self.side_channel_port < 65536:
            bad("side_channel_port", "must be a port number (0: any)")

    def saves_to_store(self, kv_role: str) -> bool:
        if not self.master:
            return False
        return kv_role in ("kv_producer", "kv_both") if self.store_save is None else self.store_save

    def loads_from_store(self, kv_role: str) -> bool:
        if not self.master:
            return False
        return kv_role in ("kv_consumer", "kv_both") if self.store_load is None else self.store_load


def _typed(name: str, value: Any, default: Any) -> Any:
    """value converted to the type of the key's default; InvalidArgumentError naming the key."""
    def bad(expected: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"kv_connector_extra_config[{name!r}] = {value!r}: expected {expected}")

    if default is None or isinstance(default, bool):  # the optional booleans
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise bad("true or false")
    if isinstance(default, int):
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise bad("an integer")
    if isinstance(default, float):
        if isinstance(value, bool):
            raise bad("a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad("a number") from None
    if not isinstance(value, str):
        raise bad("a string")
    return value


# --------------------------------------------------------------------------------------------
# Block runs
# --------------------------------------------------------------------------------------------


def merge_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local first block, remote first block, count) for the runs where both lists go up by
    one at the same time: a run is one contiguous range on each side, so one op per layer."""
    if len(local) != len(remote):
        raise InvalidArgumentError(
            f"merge_runs: {len(local)} local blocks but {len(remote)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


# --------------------------------------------------------------------------------------------
# Content keys of the shared prefix store
# --------------------------------------------------------------------------------------------

_KEY_DOMAIN = b"kvbridge-vllm-prefix-v1"


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int,
                 salt: bytes = b"") -> list[str]:
    """The hex digests of the first ``num_blocks`` full blocks of ``token_ids``: block i's hash
    covers every token of blocks 0..i (a chain, like vLLM's prefix-cache hashes) plus
    ``salt`` (cache salt, LoRA, multimodal identifiers). vLLM's own block hashes are not used:
    with its default hash they are seeded per process, so two instances would never agree."""
    if block_size <= 0:
        raise InvalidArgumentError(f"chain_hashes: block_size {block_size} must be positive")
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    prev = hashlib.sha256(_KEY_DOMAIN + len(salt).to_bytes(4, "little") + salt).digest()
    out = []
    for i in range(num_blocks):
        toks = array("q", token_ids[i * block_size:(i + 1) * block_size])
        if sys.byteorder != "little":
            toks.byteswap()
        prev = hashlib.sha256(prev + toks.tobytes()).digest()
        out.append(prev.hex())
    return out


def key_prefix(model_tag: str, tp_rank: int, tp_size: int) -> str:
    """Where one model's (and one tensor-parallel rank's) blocks live in the store."""
    return f"vllm/{model_tag}/tp{tp_rank}of{tp_size}"


def block_keys(prefix: str, hashes: Iterable[str]) -> list[str]:
    return [f"{prefix}/{h}" for h in hashes]


def model_tag(*parts: Any) -> str:
    """A short stable tag for what makes blocks interchangeable: model, KV dtype, block size,
    layer geometry. Two instances agree on it exactly when they may share blocks."""
    h = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()
    return h[:16]


def request_salt(cache_salt: Optional[str], lora_name: Optional[str],
                 mm_identifiers: Sequence[str]) -> bytes:
    """What besides the tokens makes two prompts' KV differ."""
    return json.dumps([cache_salt or "", lora_name or "", list(mm_identifiers)]).encode()


# --------------------------------------------------------------------------------------------
# The KV tensors' layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPart:
    """One contiguous piece of every block of one layer: block b's piece is ``block_bytes``
    at ``base + b * block_stride`` (a layer has one part when K and V are packed in a block,
    two for layouts with K/V outside the block dimension)."""

    base: int
    block_stride: int
    block_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class KvLayout:
    """Every registered layer's parts, layers in name order."""

    names: tuple[str, ...]
    parts: tuple[tuple[LayerPart, ...], ...]
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        return sum(p.block_bytes for parts in self.parts for p in parts)

    @property
    def num_blocks(self) -> int:
        return min(p.num_blocks for parts in self.parts for p in parts)

    def signature(self) -> str:
        """What two instances must agree on to copy blocks between them (not the addresses
        nor the number of blocks)."""
        return model_tag(self.names, [[p.block_bytes for p in ps] for ps in self.parts],
                         self.dtype)

    def block_pieces(self, block: int) -> tuple[list[int], list[int]]:
        """(addresses, lengths) of one block over every layer and part, in layout order."""
        addrs, lens = [], []
        for parts in self.parts:
            for p in parts:
                addrs.append(p.base + block * p.block_stride)
                lens.append(p.block_bytes)
        return addrs, lens

    def regions(self) -> list[tuple[int, int]]:
        """The memory the layers span, as merged (address, length) ranges to register."""
        spans = sorted((p.base, p.base + (p.num_blocks - 1) * p.block_stride + p.block_bytes)
                       for parts in self.parts for p in parts)
        merged: list[list[int]] = []
        for s, e in spans:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        return [(s, e - s) for s, e in merged]


def layout_of(kv_caches: dict, num_blocks: Optional[int] = None) -> KvLayout:
    """The layout of vLLM's per-layer KV tensors, read from shapes and strides.

    The block dimension is the first one of size ``num_blocks`` (vLLM's KVCacheConfig; the
    first dimension when not given); every index of the dimensions before it is a part, and the
    dimensions after it must be one contiguous piece per block (true of vLLM's layouts: packed
    K|V ``[blocks, heads, block_size, 2*head]`` on CPU, FlashInfer ``[blocks, 2, ...]``,
    FlashAttention ``[2, blocks, ...]``, MLA). InvalidArgumentError names a layer that is not."""
    if not kv_caches:
        raise InvalidArgumentError("register_kv_caches: no KV tensors")
    names = tuple(sorted(kv_caches))
    dtypes = set()
    all_parts = []
    for name in names:
        t = kv_caches[name]
        dtypes.add(str(t.dtype))
        shape, stride, elem = tuple(t.shape), tuple(t.stride()), t.element_size()
        nb = num_blocks if num_blocks else shape[0]
        if nb not in shape:
            raise InvalidArgumentError(
                f"KV tensor {name!r} of shape {shape}: no dimension of {nb} blocks")
        bdim = shape.index(nb)
        inner_shape, inner_stride = shape[bdim + 1:], stride[bdim + 1:]
        expected = 1
        for size, st in reversed(list(zip(inner_shape, inner_stride))):
            if size != 1 and st != expected:
                raise InvalidArgumentError(
                    f"KV tensor {name!r} of shape {shape}, strides {stride}: one block's "
                    f"elements are not contiguous; kvbridge moves each block as one range")
            expected *= size
        block_bytes = expected * elem
        outer = [()]
        for size in shape[:bdim]:
            outer = [o + (i,) for o in outer for i in range(size)]
        parts = []
        for idx in outer:
            off = sum(i * s for i, s in zip(idx, stride[:bdim])) * elem
            parts.append(LayerPart(t.data_ptr() + off, stride[bdim] * elem, block_bytes, nb))
        all_parts.append(tuple(parts))
    if len(dtypes) != 1:
        raise InvalidArgumentError(f"KV tensors of several dtypes: {sorted(dtypes)}")
    return KvLayout(names, tuple(all_parts), dtypes.pop())


def kv_device(kv_caches: dict) -> Optional[int]:
    """The CUDA device index of KV tensors that are all on one GPU; None otherwise (host KV, or
    KV spread over several devices or kinds, which is staged)."""
    devices = {(t.device.type, t.device.index or 0) for t in kv_caches.values()}
    if len(devices) != 1:
        return None
    kind, index = devices.pop()
    return index if kind == "cuda" else None


def register_device_kv(layout: KvLayout, device: int, engine: Any = None,
                       store: Any = None) -> list[tuple[int, int, int]]:
    """Registers the memory `layout` spans as CUDA memory of `device`: with `engine` (a
    kvbridge.TransferEngine) and `store` (a kvbridge.StoreClient), each when given. Returns
    (address, length, segment id) per region (segment -1 without an engine). All or nothing:
    on any error what was registered is undone and the error raised (without a CUDA driver:
    UnsupportedError from the engine, UnavailableError from the store)."""
    from kvbridge._buffers import CUDA, Region

    regions = [Region(a, n, CUDA, device) for a, n in layout.regions()]
    segs: list[tuple[int, int, int]] = []
    stored: list[Region] = []
    try:
        for r in regions:
            segs.append((r.address, r.length, engine.register(r) if engine is not None else -1))
        for r in regions:
            if store is not None:
                store.register_buffer(r)
                stored.append(r)
    except BaseException:
        for _, _, seg in segs:
            if seg >= 0:
                engine.deregister(seg)
        for r in stored:
            store.unregister_buffer(r)
        raise
    return segs


# --------------------------------------------------------------------------------------------
# Request parameters of prefill/decode disaggregation
# --------------------------------------------------------------------------------------------

PARAMS_VERSION = 1


@dataclass(frozen=True)
class RankEndpoint:
    """Where one tensor-parallel rank of the prefill instance serves its blocks, and which
    engine incarnation holds them."""

    endpoint: str  # "host:port" of the rank's side channel
    node_id: str
    incarnation: int

    def to_json(self) -> dict:
        return {"endpoint": self.endpoint, "node_id": self.node_id,
                "incarnation": f"{self.incarnation:#018x}"}

    @classmethod
    def from_json(cls, d: Any, where: str) -> "RankEndpoint":
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"{where}: expected an object")
        try:
            ep, node, inc = d["endpoint"], d["node_id"], d["incarnation"]
        except KeyError as e:
            raise InvalidArgumentError(f"{where}: missing {e.args[0]!r}") from None
        if not isinstance(ep, str) or ":" not in ep or not isinstance(node, str) or not node:
            raise InvalidArgumentError(f"{where}: malformed endpoint or node_id")
        try:
            inc_v = int(inc, 16) if isinstance(inc, str) else int(inc)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{where}.incarnation {inc!r}: not a hex number") from None
        return cls(ep, node, inc_v)


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode instance needs to pull a request's prompt KV from a prefill instance."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    ranks: tuple[RankEndpoint, ...]
    layout: str  # KvLayout.signature() of the prefill instance
    hold_s: float  # how long the prefill keeps the blocks for the decode
    tokens: str  # tokens_hash() of the first num_tokens prompt tokens


def tokens_hash(token_ids: Sequence[int]) -> str:
    """A digest of the tokens a request's prompt KV was computed from: the decode instance
    refuses parameters whose prompt is not its own (a router mixing up requests)."""
    toks = array("q", token_ids)
    if sys.byteorder != "little":
        toks.byteswap()
    return hashlib.sha256(toks.tobytes()).hexdigest()[:32]


def prefill_params(engine_id: str, request_id: str, block_ids: Sequence[int], num_tokens: int,
                   ranks: Sequence[RankEndpoint], layout: str, hold_s: float,
                   tokens: str) -> dict:
    """The kv_transfer_params a prefill instance returns; a router passes them, unchanged, to
    the decode instance's request."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvbridge": PARAMS_VERSION,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [int(b) for b in block_ids],
        "remote_num_tokens": int(num_tokens),
        "remote_ranks": [r.to_json() for r in ranks],
        "remote_layout": layout,
        "remote_hold_s": float(hold_s),
        "remote_tokens_hash": tokens,
    }


def parse_remote_prefill(params: Any) -> RemotePrefill:
    """The decode side's reading of prefill_params(); InvalidArgumentError names what is
    missing or malformed."""
    if not isinstance(params, dict):
        raise InvalidArgumentError(
            f"kv_transfer_params: expected a dict, got {type(params).__name__}")
    version = params.get("kvbridge")
    if version != PARAMS_VERSION:
        raise InvalidArgumentError(
            f"kv_transfer_params['kvbridge'] = {version!r}: expected {PARAMS_VERSION} "
            "(the parameters a KvbridgeConnector prefill instance returned)")
    for k in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_num_tokens",
              "remote_ranks", "remote_layout", "remote_hold_s", "remote_tokens_hash"):
        if k not in params:
            raise InvalidArgumentError(f"kv_transfer_params: missing {k!r}")
    blocks = params["remote_block_ids"]
    if (not isinstance(blocks, list) or not blocks
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)):
        raise InvalidArgumentError("kv_transfer_params['remote_block_ids']: expected a non-empty "
                                   "list of block ids")
    n = params["remote_num_tokens"]
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise InvalidArgumentError(f"kv_transfer_params['remote_num_tokens'] = {n!r}: expected "
                                   "a positive integer")
    ranks = params["remote_ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise InvalidArgumentError("kv_transfer_params['remote_ranks']: expected a non-empty list")
    parsed = tuple(RankEndpoint.from_json(r, f"kv_transfer_params['remote_ranks'][{i}]")
                   for i, r in enumerate(ranks))
    try:
        hold = float(params["remote_hold_s"])
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            "kv_transfer_params['remote_hold_s']: expected a number") from None
    return RemotePrefill(str(params["remote_engine_id"]), str(params["remote_request_id"]),
                         tuple(blocks), n, parsed, str(params["remote_layout"]), hold,
                         str(params["remote_tokens_hash"]))


# --------------------------------------------------------------------------------------------
# Counters
# --------------------------------------------------------------------------------------------

COUNTERS = (
    "pd_requests_loaded",  # decode: requests whose prompt KV was pulled completely
    "pd_requests_failed",  # decode: requests with at least one block that could not be pulled
    "pd_blocks_read",
    "pd_bytes_read",
    "pd_blocks_invalid",  # decode: blocks reported to vLLM as not loaded
    "pd_requests_held",  # prefill: requests whose blocks were kept for a decode
    "pd_requests_released",  # prefill: freed because the decode said it was done
    "pd_requests_expired",  # prefill: freed after hold_timeout_s without a release
    "store_blocks_put",
    "store_bytes_put",
    "store_put_failures",
    "store_blocks_get",
    "store_bytes_get",
    "store_blocks_invalid",  # blocks a store load could not fill (reported to vLLM)
    "store_lookup_hits",  # scheduler: blocks get_num_new_matched_tokens found in the store
    # The store client's own counters (kvbridge.store.client_stats_summary), per key: what it
    # read (hits, of which from an SSD replica, misses), wrote, failed, the keys gets asked
    # for, and per call kind its calls and their summed wall time in microseconds.
    "store_client_get_hits",
    "store_client_get_hits_ssd",
    "store_client_get_misses",
    "store_client_bytes_read",
    "store_client_bytes_written",
    "store_client_puts_stored",
    "store_client_errors",
    "store_client_get_keys",
    "store_client_get_calls",
    "store_client_get_us",
    "store_client_put_calls",
    "store_client_put_us",
    "store_client_exists_calls",
    "store_client_exists_us",
)


def derived_stats(totals: dict) -> dict:
    """What vLLM's log of the connector stats adds to the summed counters: the store
    client's hit rate and mean call times (ms), where there were calls."""
    out = {}
    asked = totals.get("store_client_get_keys", 0)
    if asked:
        out["store_client_hit_rate"] = totals.get("store_client_get_hits", 0) / asked
    for op in ("get", "put", "exists"):
        calls = totals.get(f"store_client_{op}_calls", 0)
        if calls:
            out[f"store_client_{op}_mean_ms"] = totals.get(f"store_client_{op}_us", 0) / calls / 1e3
    return out


class Counters:
    """Cumulative counters of one connector instance, thread-safe. ``take_delta()`` gives
    what changed since the last call (vLLM's per-interval stats); ``write(path)`` saves the
    totals as JSON (atomically) for whoever wants to read them from outside."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = {k: 0 for k in COUNTERS}
        self._reported = dict(self._total)
        self._written: Optional[dict] = None
        self._write_lock = threading.Lock()
        # [store client, its last summary]: their sums are the store_client_* totals.
        self._stores: list[list] = []

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._total[k] += int(v)

    def track_store(self, store: Any) -> None:
        """Makes the store_client_* counters `store`'s (summed over the clients tracked),
        read from its stats() whenever the counters are."""
        with self._lock:
            self._stores.append([store, {}])

    def _read_stores(self) -> None:
        """REQUIRES: self._lock held."""
        from kvbridge.errors import KvbError
        from kvbridge.store import client_stats_summary

        sums: dict = {}
        for entry in self._stores:
            try:
                entry[1] = client_stats_summary(entry[0].stats())
            except KvbError:  # closed: its last totals stand
                pass
            for k, v in entry[1].items():
                sums[k] = sums.get(k, 0) + v
        self._total.update(sums)

    def snapshot(self) -> dict:
        with self._lock:
            self._read_stores()
            return dict(self._total)

    def take_delta(self) -> dict:
        with self._lock:
            self._read_stores()
            delta = {k: v - self._reported[k] for k, v in self._total.items()
                     if v != self._reported[k]}
            self._reported = dict(self._total)
            return delta

    def write(self, path: str, extra: Optional[dict] = None) -> None:
        with self._write_lock:
            snap = self.snapshot()
            if snap == self._written:
                return
            body = dict(snap)
            body.update(extra or {})
            d = os.path.dirname(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".kvbridge-stats-")
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            os.replace(tmp, path)
            self._written = snap


def stats_path(template: str, rank: int) -> str:
    """The stats file of one rank: ``{rank}`` in the template is replaced; without it rank 0
    writes the path itself and rank N the path plus ``.rankN``."""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else f"{template}.rank{rank}"


@dataclass
class PullResult:
    """The outcome of pulling one request's blocks."""

    ok: bool
    invalid_blocks: set = field(default_factory=set)  # local block ids not loaded
    blocks: int = 0
    bytes: int = 0
    error: str = ""
