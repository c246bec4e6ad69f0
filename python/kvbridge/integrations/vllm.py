"""kvbridge as a vLLM KV connector (V1): prefill/decode disaggregation and a shared prefix store.

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KvbridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_connector_extra_config": {"master": "10.0.0.1:50051", ...}})

* **Prefill/decode** (per request, by ``kv_transfer_params``): a prefill instance
  (kv_producer/kv_both) given ``{"do_remote_decode": True}`` keeps the request's blocks after
  it finishes and returns parameters naming them; the decode instance (kv_consumer/kv_both)
  given those parameters pulls the blocks with one-sided READs of kvbridge's TransferEngine
  straight into its own KV tensors, then tells the prefill to free them.
* **Shared prefix store** (when ``master`` is set): full prompt blocks are written to the
  kvbridge store under content keys (a hash chain over the tokens, the model's tag and the
  tensor-parallel rank); a new request's leading run of blocks found in the store is read
  straight into the registered KV tensors. Any instance pointed at the same master reuses them.

A block that cannot be loaded (prefill killed, frozen or restarted, store object gone) is
reported to vLLM, which recomputes it or fails the request as ``kv_load_failure_policy`` says;
every load ends within its deadline. docs/vllm.md has the configuration, the parameters a
router passes, and the failure behaviour.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

import kvbridge
from kvbridge import errors
from kvbridge.integrations._vllm_core import (
    Counters,
    KvLayout,
    PullResult,
    RemotePrefill,
    RankEndpoint,
    Settings,
    block_keys,
    chain_hashes,
    derived_stats,
    key_prefix,
    kv_device,
    layout_of,
    model_tag,
    parse_remote_prefill,
    prefill_params,
    register_device_kv,
    request_salt,
    stats_path,
    tokens_hash,
)
from kvbridge.integrations._vllm_pd import PdPuller, PdServer
from kvbridge.integrations._vllm_stage import Stager

try:  # vLLM 0.32+: where external hits came from, for its cache metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvbridgeConnector", "KvbridgeConnectorMetadata", "KvbridgeConnectorStats",
           "KvbridgeHandshake"]

# Under "vllm." so that vLLM's logging configuration (handlers, level, process prefix) applies.
log = logging.getLogger("vllm.kvbridge")

# After a failed store call, lookups (scheduler) and saves (worker) pause this long.
_STORE_BACKOFF_S = 5.0


def _block_pieces(io: Any, slots: list) -> tuple[list, list]:
    """Parallel (addresses, lengths) lists of each slot's pieces in io (a KvLayout)."""
    addrs, lens = [], []
    for slot in slots:
        a, n = io.block_pieces(slot)
        addrs.append(a)
        lens.append(n)
    return addrs, lens


# --------------------------------------------------------------------------------------------
# What travels between the connector's halves
# --------------------------------------------------------------------------------------------


@dataclass
class _RecvJob:
    """Decode: pull ``remote.block_ids[i]`` into ``local_blocks[i]`` (empty: only release)."""

    req_id: str
    local_blocks: list
    remote_blocks: list
    remote: RemotePrefill
    arrival_time: float
    release_only: bool = False


@dataclass
class _StoreJob:
    """Store: blocks ``block_ids`` of a request and the chain hashes of their content."""

    req_id: str
    block_ids: list
    hashes: list


@dataclass
class KvbridgeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    pd_recv: list = field(default_factory=list)  # [_RecvJob]
    pd_hold: dict = field(default_factory=dict)  # request id -> seconds to keep its blocks
    store_load: list = field(default_factory=list)  # [_StoreJob], loaded before the forward
    store_save: list = field(default_factory=list)  # [_StoreJob], saved after it


@dataclass
class KvbridgeHandshake(KVConnectorHandshakeMetadata):
    """Worker rank -> scheduler, once: what the scheduler puts in the parameters it returns."""

    endpoint: str  # the rank's side channel ("" when it does not serve prefill blocks)
    node_id: str
    incarnation: int
    layout: str  # KvLayout.signature()
    key_prefix: str  # where this rank's blocks live in the store


@dataclass
class KvbridgeConnectorStats(KVConnectorStats):
    """Counters moved in an interval (kvbridge.integrations._vllm_core.COUNTERS), summed over
    workers, the store client's among them (store_client_*); vLLM logs them as "KV Transfer
    metrics", with the store client's hit rate and mean call times derived from the sums."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvbridgeConnectorStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict:
        out = dict(self.data)
        out.update(derived_stats(self.data))
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_host() -> str:
    try:
        from vllm.utils.network_utils import get_ip
        return get_ip()
    except Exception:  # pragma: no cover - older layouts of vllm.utils
        return socket.gethostbyname(socket.gethostname())


# --------------------------------------------------------------------------------------------
# The connector
# --------------------------------------------------------------------------------------------


class KvbridgeConnector(KVConnectorBase_V1):
    """vLLM's KVConnectorBase_V1 over kvbridge. One instance in the scheduler, one per worker;
    each half lives in its own object (_SchedulerSide / _WorkerSide)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "Optional[KVCacheConfig]" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._settings = Settings.from_extra(ktc.kv_connector_extra_config, ktc.kv_role)
        if role == KVConnectorRole.SCHEDULER:
            self._sched: Optional[_SchedulerSide] = _SchedulerSide(
                vllm_config, self._settings, kv_cache_config)
            self._worker: Optional[_WorkerSide] = None
        else:
            self._sched = None
            self._worker = _WorkerSide(vllm_config, self._settings, kv_cache_config)

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv (store) or before the request is scheduled (PD)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks are saved once per step, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set], Optional[set]]:
        assert self._worker is not None
        return self._worker.finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_invalid()

    def get_handshake_metadata(self) -> Optional[KvbridgeHandshake]:
        return self._worker.handshake() if self._worker is not None else None

    def get_kv_connector_stats(self) -> Optional[KvbridgeConnectorStats]:
        side = self._worker if self._worker is not None else self._sched
        delta = side.counters.take_delta() if side is not None else {}
        return KvbridgeConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> KvbridgeConnectorStats:
        return KvbridgeConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        assert self._sched is not None
        return self._sched.finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        if self._sched is not None:
            self._sched.set_ranks(metadata)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int):
        if (CacheHitSource is not None and num_external_tokens and self._sched is not None
                and request.request_id in self._sched.pd_requests):
            return {CacheHitSource.P2P: num_external_tokens}
        return super().get_external_cache_hit_sources(request, num_external_tokens)


# --------------------------------------------------------------------------------------------
# Scheduler side
# --------------------------------------------------------------------------------------------


@dataclass
class _SaveState:
    request: Any
    saved: int  # blocks [0, saved) are in the store or not to be saved
    blocks: list = field(default_factory=list)


class _SchedulerSide:
    def __init__(self, vllm_config: "VllmConfig", settings: Settings, kv_cache_config: Any):
        ktc = vllm_config.kv_transfer_config
        self.s = settings
        self.kv_role = ktc.kv_role
        self.engine_id = ktc.engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.producer = self.kv_role in ("kv_producer", "kv_both")
        self.consumer = self.kv_role in ("kv_consumer", "kv_both")
        self.store_save = settings.saves_to_store(self.kv_role)
        self.store_load = settings.loads_from_store(self.kv_role)
        self.counters = Counters()
        self.ranks: list[RankEndpoint] = []
        self.layout = ""
        self.prefix = ""  # the store key prefix of rank 0 (lookups)
        self._store: Optional[kvbridge.StoreClient] = None
        self._store_failed_at = 0.0
        self._lookup_paused_until = 0.0
        self._recv: list[_RecvJob] = []
        self._hold: dict[str, float] = {}
        self._loads: list[_StoreJob] = []
        self._lookups: dict[str, tuple[int, int]] = {}  # req -> (first block, blocks hit)
        self._hashes: dict[str, list[str]] = {}
        self._save: dict[str, _SaveState] = {}
        self.pd_requests: set[str] = set()
        self._warned: set[str] = set()

    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def set_ranks(self, metadata: dict) -> None:
        ranks = []
        for rank in sorted(metadata):
            m = metadata[rank]
            if not isinstance(m, KvbridgeHandshake):
                raise errors.InvalidArgumentError(
                    f"KvbridgeConnector: handshake metadata of rank {rank} is "
                    f"{type(m).__name__}, expected KvbridgeHandshake")
            ranks.append(RankEndpoint(m.endpoint, m.node_id, m.incarnation))
        self.ranks = ranks
        if metadata:
            first = metadata[sorted(metadata)[0]]
            self.layout, self.prefix = first.layout, first.key_prefix

    def store(self) -> Optional[kvbridge.StoreClient]:
        """The scheduler's store client (existence checks only), made on first use; after a
        failure to connect it is retried at most every 5 s."""
        if self._store is None and time.monotonic() - self._store_failed_at > 5.0:
            try:
                self._store = _store_client(self.s)
                self.counters.track_store(self._store)
            except errors.KvbError as e:
                self._store_failed_at = time.monotonic()
                log.warning("kvbridge store at %s unavailable for lookups: %s", self.s.master, e)
        return self._store

    def _chain(self, request: "Request", num_blocks: int) -> list[str]:
        got = self._hashes.get(request.request_id)
        if got is None or len(got) < num_blocks:
            lora = getattr(request, "lora_request", None)
            salt = request_salt(getattr(request, "cache_salt", None),
                                getattr(lora, "lora_name", None) if lora else None,
                                [getattr(f, "identifier", "") for f in
                                 (getattr(request, "mm_features", None) or [])])
            got = chain_hashes(request.prompt_token_ids, self.block_size,
                               request.num_prompt_tokens // self.block_size, salt)
            self._hashes[request.request_id] = got
        return got[:num_blocks]

    # -- get_num_new_matched_tokens ------------------------------------------------------------
    def matched(self, request: "Request", num_computed: int) -> tuple[Optional[int], bool]:
        if request.request_id in self.pd_requests:
            # A pull that failed (kv_load_failure_policy "recompute"): computed here, as the
            # policy says, not looked up in the store.
            return 0, False
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            rp = self._remote(request)
            if rp is None:
                return 0, False
            n = min(rp.num_tokens, request.num_prompt_tokens)
            return (n - num_computed, True) if n > num_computed else (0, False)
        if request.prompt_token_ids is None or not (self.store_load or self.store_save):
            return 0, False
        start = num_computed // self.block_size
        self._lookups[request.request_id] = (start, 0)
        if not self.store_load or not self.prefix:
            return 0, False
        last = (request.num_prompt_tokens - 1) // self.block_size  # one token left to compute
        if last <= start:
            return 0, False
        store = self.store()
        if store is None or time.monotonic() < self._lookup_paused_until:
            return 0, False
        keys = block_keys(self.prefix, self._chain(request, last)[start:last])
        try:
            found = store.batch_exists(keys)
        except errors.KvbError as e:
            # The store (master) is down or slow: compute locally, and stop asking for a
            # while so that every new request does not wait out the RPC timeout.
            self._lookup_paused_until = time.monotonic() + _STORE_BACKOFF_S
            log.warning("kvbridge store lookup failed (%s); computing locally, no lookups for "
                        "%.0f s", e, _STORE_BACKOFF_S)
            return 0, False
        hit = 0
        while hit < len(found) and found[hit]:
            hit += 1
        self._lookups[request.request_id] = (start, hit)
        if hit == 0:
            return 0, False
        return (start + hit) * self.block_size - num_computed, False

    def _remote(self, request: "Request", release: bool = False) -> Optional[RemotePrefill]:
        """The request's prefill parameters, or None (and a warning) when they are unusable:
        the request is then computed here. With ``release``, well-formed parameters for
        another prompt still free the prefill's blocks (they are of no use to anyone)."""
        if not self.consumer:
            self._warn_once("role", "request %s asks for a remote prefill but kv_role is %s; "
                            "computing it locally", request.request_id, self.kv_role)
            return None
        try:
            rp = parse_remote_prefill(request.kv_transfer_params)
        except errors.InvalidArgumentError as e:
            log.warning("request %s: %s; computing it locally", request.request_id, e)
            return None
        n = min(rp.num_tokens, request.num_prompt_tokens)
        if request.prompt_token_ids is None or \
                tokens_hash(request.prompt_token_ids[:n]) != rp.tokens:
            log.warning("request %s: kv_transfer_params were made for another prompt; computing "
                        "it locally", request.request_id)
            if release:
                self._recv.append(_RecvJob(request.request_id, [], [], rp, request.arrival_time,
                                           True))
            return None
        return rp

    # -- update_state_after_alloc --------------------------------------------------------------
    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external: int) -> None:
        rid = request.request_id
        params = request.kv_transfer_params
        if rid in self.pd_requests:
            return  # second call after the async load: nothing more to do
        if params and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # one transfer per request
            rp = self._remote(request, release=True)
            if rp is None:
                return
            self.pd_requests.add(rid)
            if num_external <= 0:  # everything was here already: only free the prefill's copy
                self._recv.append(_RecvJob(rid, [], [], rp, request.arrival_time, True))
                return
            n = min(rp.num_tokens, request.num_prompt_tokens)
            first = (n - num_external) // self.block_size
            nblocks = _cdiv(n, self.block_size)
            local = list(blocks.get_block_ids()[0][first:nblocks])
            remote = list(rp.block_ids[first:nblocks])
            self._recv.append(_RecvJob(rid, local, remote, rp, request.arrival_time))
            return
        if request.prompt_token_ids is None:
            return
        start, hit = self._lookups.pop(rid, (0, 0))
        loaded = 0
        if num_external > 0 and hit:
            loaded = min(hit, num_external // self.block_size)
            ids = list(blocks.get_block_ids()[0][start:start + loaded])
            self._loads.append(_StoreJob(rid, ids, self._chain(request, start + loaded)[start:]))
            self.counters.add(store_lookup_hits=loaded)
        if self.store_save:
            old = self._save.get(rid)
            saved = max(start + loaded, old.saved if old else 0)
            self._save[rid] = _SaveState(request, saved, old.blocks if old else [])

    # -- build_connector_meta ------------------------------------------------------------------
    def build_meta(self, out: "SchedulerOutput") -> KvbridgeConnectorMetadata:
        meta = KvbridgeConnectorMetadata(pd_recv=self._recv, pd_hold=self._hold,
                                         store_load=self._loads)
        self._recv, self._hold, self._loads = [], {}, []
        if not self._save:
            return meta
        scheduled = out.num_scheduled_tokens or {}
        for new in out.scheduled_new_reqs:
            st = self._save.get(new.req_id)
            if st is not None:
                st.blocks = list(new.block_ids[0]) if new.block_ids else []
                self._collect(meta, new.req_id, st,
                              new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self._save.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in resumed:
                st.blocks = list(nb[0]) if nb else []
            elif nb:
                st.blocks.extend(nb[0])
            self._collect(meta, rid, st, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _collect(self, meta: KvbridgeConnectorMetadata, rid: str, st: _SaveState,
                 computed: int) -> None:
        req = st.request
        full = min(computed, req.num_prompt_tokens) // self.block_size
        if full <= st.saved or len(st.blocks) < full:
            return
        hashes = self._chain(req, full)
        meta.store_save.append(_StoreJob(rid, st.blocks[st.saved:full], hashes[st.saved:full]))
        st.saved = full

    # -- request_finished ----------------------------------------------------------------------
    def finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._lookups.pop(rid, None)
        self._hashes.pop(rid, None)
        self._save.pop(rid, None)
        self.pd_requests.discard(rid)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: let the prefill free its blocks now.
            params["do_remote_prefill"] = False
            rp = self._remote(request, release=True)
            if rp is not None:
                self._recv.append(_RecvJob(rid, [], [], rp, request.arrival_time, True))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not self.producer:
            self._warn_once("decode-role", "request %s asks to be decoded elsewhere but kv_role "
                            "is %s; its KV is not kept", rid, self.kv_role)
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None
        if not self.ranks or not all(r.endpoint for r in self.ranks):
            self._warn_once("ranks", "no side channel known for this instance's workers; "
                            "request %s cannot be handed to a decode instance", rid)
            return False, None
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        hold = self.s.hold_timeout_s
        self._hold[rid] = hold
        return True, prefill_params(self.engine_id, rid, block_ids, n, self.ranks, self.layout,
                                    hold, tokens_hash(request.prompt_token_ids[:n]))

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def _store_client(s: Settings) -> kvbridge.StoreClient:
    kw: dict[str, Any] = {"master": s.master, "replica_num": s.replica_num}
    if s.store_rpc_timeout_ms:
        kw["rpc_timeout_ms"] = s.store_rpc_timeout_ms
    if s.store_transfer_deadline_ms:
        kw["store_transfer_deadline_ms"] = s.store_transfer_deadline_ms
    if s.cluster_token:
        kw["cluster_token"] = s.cluster_token
    if s.transports:
        kw["transports"] = s.transports
    return kvbridge.StoreClient(**kw)


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


class _WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", settings: Settings, kv_cache_config: Any):
        ktc = vllm_config.kv_transfer_config
        self.s = settings
        self.vllm_config = vllm_config
        self.kv_role = ktc.kv_role
        self.engine_id = ktc.engine_id
        self.kv_cache_config = kv_cache_config
        self.producer = self.kv_role in ("kv_producer", "kv_both")
        self.consumer = self.kv_role in ("kv_consumer", "kv_both")
        self.store_save = settings.saves_to_store(self.kv_role)
        self.store_load = settings.loads_from_store(self.kv_role)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:
            self.tp_rank = 0
        self.counters = Counters()
        self.layout: Optional[KvLayout] = None
        self.io_layout: Optional[KvLayout] = None  # what kvbridge moves: layout or pages
        self.stager: Optional[Stager] = None
        self.engine: Optional[kvbridge.TransferEngine] = None
        self.store: Optional[kvbridge.StoreClient] = None
        self.server: Optional[PdServer] = None
        self.puller: Optional[PdPuller] = None
        self.prefix = ""
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.load_threads, thread_name_prefix="kvbridge-vllm-pull")
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._invalid: set[int] = set()
        self._save_paused_until = 0.0
        self._stats_file = stats_path(settings.stats_file, self.tp_rank) if settings.stats_file \
            else ""

    # -- registration --------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        devices = {t.device.type for t in kv_caches.values()}
        if not devices <= {"cpu", "cuda"}:
            raise errors.UnsupportedError(f"KvbridgeConnector: KV tensors on {sorted(devices)}")
        num_blocks = getattr(self.kv_cache_config, "num_blocks", None)
        self.layout = layout = layout_of(kv_caches, num_blocks)
        host = self.s.host or _default_host()
        kw: dict[str, Any] = {
            "node_id": f"vllm-{self.engine_id}-tp{self.tp_rank}-{socket.gethostname()}-"
                       f"{os.getpid()}",
            "listen": f"{host}:0",
            "deadline_ms": self.s.transfer_deadline_ms,
            "progress_timeout_ms": self.s.progress_timeout_ms,
        }
        if self.s.cluster_token:
            kw["cluster_token"] = self.s.cluster_token
        if self.s.transports:
            kw["transports"] = self.s.transports
        if self.producer or self.consumer:
            self.engine = kvbridge.TransferEngine(**kw)
        if self.store_save or self.store_load:
            self.store = _store_client(self.s)
            self.counters.track_store(self.store)
        segs, where = self._register_kv(kv_caches, layout)
        if self.engine is not None:
            if self.producer and self.stager is None:
                port = self.s.side_channel_port + self.tp_rank if self.s.side_channel_port else 0
                self.server = PdServer(self.engine, layout, segs, host, port, self.counters)
            elif self.producer:
                log.warning("KvbridgeConnector: KV staged through host pages: this instance "
                            "does not serve prefill blocks to decode instances (requests with "
                            "do_remote_decode are not handed off)")
            if self.consumer:
                self.puller = PdPuller(self.engine, self.io_layout, self.s.handshake_timeout_ms,
                                       self.s.transfer_deadline_ms, self.s.progress_timeout_ms)
        mc = self.vllm_config.model_config
        tag = self.s.model_tag or model_tag(
            getattr(mc, "model", ""), getattr(mc, "revision", None), layout.signature(),
            self.vllm_config.cache_config.block_size, self.tp_size)
        self.prefix = key_prefix(tag, self.tp_rank, self.tp_size)
        log.info("KvbridgeConnector worker (tp rank %d, %s): %d layers, %d blocks of %d bytes, "
                 "%s, side channel %s, store %s, key prefix %s", self.tp_rank, self.kv_role,
                 len(layout.names), layout.num_blocks, layout.bytes_per_block, where,
                 self.server.endpoint if self.server else "-", self.s.master or "-", self.prefix)
        self._write_stats()

    def _register_kv(self, kv_caches: dict[str, torch.Tensor],
                     layout: KvLayout) -> tuple[list[tuple[int, int, int]], str]:
        """Registers the KV memory with the engine and the store (whichever exist); returns the
        (address, length, segment) of each engine region and how the KV is moved. KV on one GPU
        is registered as device memory in place (docs/vllm.md "GPUs") unless device_kv is
        "stage"; with "auto" a machine where kvbridge cannot take device memory falls back to
        staging through pinned host pages, as does KV on the host with stage_through_host and
        KV spread over several devices."""
        device = kv_device(kv_caches)
        if device is not None and self.s.device_kv != "stage" and not self.s.stage_through_host:
            try:
                segs = register_device_kv(layout, device, self.engine, self.store)
                self.io_layout = layout
                return segs, f"device memory of cuda:{device} in place"
            except (errors.UnsupportedError, errors.UnavailableError) as e:
                if self.s.device_kv == "direct":
                    raise
                log.warning("KvbridgeConnector: KV on cuda:%d cannot be registered as device "
                            "memory here (%s); staging it through pinned host pages "
                            "(device_kv=auto)", device, e)
        if {t.device.type for t in kv_caches.values()} != {"cpu"} or self.s.stage_through_host:
            self.stager = Stager(kv_caches, layout, self.s.staging_bytes)
            self.io_layout, regions = self.stager.host_layout, [self.stager.region()]
            where = f"staged through {self.stager.num_pages} host pages"
        else:
            self.io_layout, regions = layout, layout.regions()
            where = "host memory in place"
        segs = [(a, n, self.engine.register((a, n)) if self.engine is not None else -1)
                for a, n in regions]
        if self.store is not None:
            for a, n in regions:
                self.store.register_buffer((a, n))
        return segs, where

    def handshake(self) -> Optional[KvbridgeHandshake]:
        if self.layout is None:
            return None
        eid = self.engine.id if self.engine is not None else None
        return KvbridgeHandshake(self.server.endpoint if self.server else "",
                                 eid.node_id if eid else "", eid.incarnation if eid else 0,
                                 self.layout.signature(), self.prefix)

    # -- loads ---------------------------------------------------------------------------------
    def start_load(self, meta: KvbridgeConnectorMetadata) -> None:
        if meta.pd_hold and self.server is not None:
            self.server.hold(meta.pd_hold)
            self.counters.add(pd_requests_held=len(meta.pd_hold))
        for job in meta.pd_recv:
            if self.puller is None:
                log.warning("request %s: remote prefill on a worker that does not pull", job.req_id)
                if not job.release_only:
                    fut: concurrent.futures.Future = concurrent.futures.Future()
                    fut.set_result(PullResult(False, set(job.local_blocks), error="no puller"))
                    self._inflight[job.req_id] = fut
                continue
            fut = self._pool.submit(self._pull, job)
            if not job.release_only:
                self._inflight[job.req_id] = fut
        if meta.store_load:
            self._store_load(meta.store_load)

    def _pull(self, job: _RecvJob) -> PullResult:
        """One request's blocks from the prefill (a pool thread). Never raises."""
        rp = job.remote
        if len(rp.ranks) != self.tp_size:
            res = PullResult(False, set(job.local_blocks),
                             error=f"prefill has {len(rp.ranks)} tensor-parallel ranks, this "
                                   f"instance {self.tp_size}")
            log.warning("request %s: %s", job.req_id, res.error)
            self.counters.add(pd_requests_failed=1, pd_blocks_invalid=len(res.invalid_blocks))
            return res
        rank = rp.ranks[self.tp_rank]
        assert self.puller is not None
        if job.release_only:
            try:
                self.puller.release(rank, rp.request_id)
            except errors.KvbError as e:
                log.info("request %s: could not release the prefill's blocks: %s", job.req_id, e)
            return PullResult(True)
        t0 = time.monotonic()
        if time.time() - job.arrival_time > rp.hold_s:  # surely freed by now
            res = PullResult(False, set(job.local_blocks),
                             error=f"the prefill's hold of {rp.hold_s} s has run out")
        elif self.stager is None:
            res = self.puller.pull(rank, job.local_blocks, job.remote_blocks)
        else:
            res = self._pull_staged(rank, job.local_blocks, job.remote_blocks)
        try:
            held = self.puller.release(rank, rp.request_id)
            if res.ok and not held:
                res = PullResult(False, set(job.local_blocks),
                                 error="the prefill had freed the blocks before the read ended")
        except errors.KvbError as e:
            if res.ok:  # cannot confirm the blocks were still the request's: do not use them
                res = PullResult(False, set(job.local_blocks),
                                 error=f"could not confirm with the prefill: {e}")
        ms = (time.monotonic() - t0) * 1000.0
        if res.ok:
            self.counters.add(pd_requests_loaded=1, pd_blocks_read=res.blocks,
                              pd_bytes_read=res.bytes)
            log.info("request %s: pulled %d blocks (%d bytes) from %s in %.1f ms", job.req_id,
                     res.blocks, res.bytes, rank.endpoint, ms)
        else:
            self.counters.add(pd_requests_failed=1, pd_blocks_invalid=len(res.invalid_blocks))
            log.warning("request %s: %d of %d blocks not loaded from %s after %.1f ms: %s",
                        job.req_id, len(res.invalid_blocks), len(job.local_blocks),
                        rank.endpoint, ms, res.error)
        self._write_stats()
        return res

    def _pull_staged(self, rank: RankEndpoint, local: list, remote: list) -> PullResult:
        """A pull through host pages: as many blocks as free pages at a time, each batch read
        into pages and then scattered into the KV blocks."""
        stager, puller = self.stager, self.puller
        assert stager is not None and puller is not None
        done = nbytes = 0
        while done < len(local):
            pages = stager.take(len(local) - done, self.s.transfer_deadline_ms / 1000.0)
            if pages is None:
                return PullResult(False, set(local[done:]), error="no free staging pages")
            try:
                lb, rb = local[done:done + len(pages)], remote[done:done + len(pages)]
                r = puller.pull(rank, pages, rb)
                if not r.ok:
                    bad = {b for p, b in zip(pages, lb) if p in r.invalid_blocks}
                    return PullResult(False, bad | set(local[done + len(pages):]), error=r.error)
                stager.scatter(pages, lb)
            finally:
                stager.give(pages)
            done += len(pages)
            nbytes += r.bytes
        return PullResult(True, set(), blocks=len(local), bytes=nbytes)

    def _store_load(self, jobs: list) -> None:
        """Reads the blocks named by the scheduler into the KV tensors, before the forward."""
        assert self.layout is not None
        items = [(bid, f"{self.prefix}/{h}") for job in jobs
                 for bid, h in zip(job.block_ids, job.hashes)]
        if not items:
            return
        if self.store is None:
            bad = {bid for bid, _ in items}
        elif self.stager is None:
            bad = self._get([k for _, k in items], [b for b, _ in items], self.layout,
                            [b for b, _ in items])
        else:
            bad = set()
            done = 0
            while done < len(items):
                pages = self.stager.take(len(items) - done, 1.0)
                if pages is None:
                    bad |= {b for b, _ in items[done:]}
                    break
                try:
                    chunk = items[done:done + len(pages)]
                    blocks = [b for b, _ in chunk]
                    failed = self._get([k for _, k in chunk], pages, self.stager.host_layout,
                                       blocks)
                    ok = [(p, b) for p, b in zip(pages, blocks) if b not in failed]
                    if ok:
                        self.stager.scatter([p for p, _ in ok], [b for _, b in ok])
                    bad |= failed
                finally:
                    self.stager.give(pages)
                done += len(pages)
        want = self.layout.bytes_per_block
        good = len(items) - len(bad)
        self.counters.add(store_blocks_get=good, store_bytes_get=good * want,
                          store_blocks_invalid=len(bad))
        if bad:
            log.warning("kvbridge store: %d of %d blocks could not be loaded", len(bad), len(items))
            with self._lock:
                self._invalid |= bad

    def _get(self, keys: list, slots: list, io: KvLayout, blocks: list) -> set:
        """batch_get of keys into io's slots; the blocks (of the same index) that failed."""
        assert self.store is not None
        addrs, lens = _block_pieces(io, slots)
        want = io.bytes_per_block
        try:
            sizes, failed = self.store.batch_get_into_ptrs(keys, addrs, lens)
        except errors.KvbError as e:
            log.warning("kvbridge store: batch get of %d blocks failed: %s", len(keys), e)
            return set(blocks)
        return {blocks[i] for i in failed} | {blocks[i] for i, n in enumerate(sizes) if n != want}

    # -- saves ---------------------------------------------------------------------------------
    def save(self, meta: KvbridgeConnectorMetadata) -> None:
        """Writes the blocks completed in this step to the store (synchronously: vLLM may reuse
        a finished request's blocks right after the step)."""
        if not meta.store_save or self.store is None:
            return
        if time.monotonic() < self._save_paused_until:
            self.counters.add(store_put_failures=sum(len(j.block_ids) for j in meta.store_save))
            return
        layout = self.layout
        assert layout is not None
        items, seen = [], set()
        for job in meta.store_save:
            for bid, h in zip(job.block_ids, job.hashes):
                key = f"{self.prefix}/{h}"
                if key not in seen:
                    seen.add(key)
                    items.append((bid, key))
        try:
            exists = self.store.batch_exists([k for _, k in items])
            todo = [it for it, e in zip(items, exists) if not e]
            failed = 0
            if self.stager is None:
                failed = self._put(todo, [b for b, _ in todo], layout)
            else:
                done = 0
                while done < len(todo):
                    pages = self.stager.take(len(todo) - done, 1.0)
                    if pages is None:
                        failed += len(todo) - done
                        break
                    try:
                        chunk = todo[done:done + len(pages)]
                        self.stager.gather([b for b, _ in chunk], pages)
                        failed += self._put(chunk, pages, self.stager.host_layout)
                    finally:
                        self.stager.give(pages)
                    done += len(pages)
        except errors.KvbError as e:
            self._save_paused_until = time.monotonic() + _STORE_BACKOFF_S
            log.warning("kvbridge store: saving %d blocks failed (%s); no saves for %.0f s",
                        len(items), e, _STORE_BACKOFF_S)
            self.counters.add(store_put_failures=len(items))
            return
        ok = len(todo) - failed
        self.counters.add(store_blocks_put=ok, store_bytes_put=ok * layout.bytes_per_block,
                          store_put_failures=failed)

    def _put(self, items: list, slots: list, io: KvLayout) -> int:
        """batch_put of items' keys from io's slots; the number that failed."""
        if not items:
            return 0
        assert self.store is not None
        addrs, lens = _block_pieces(io, slots)
        failed = self.store.batch_put_from_ptrs([k for _, k in items], addrs, lens)
        if failed:
            first = next(iter(failed.values()))
            log.warning("kvbridge store: %d of %d blocks not saved (first: %s %s)", len(failed),
                        len(items), first.name, first.message)
        return len(failed)

    # -- completions ---------------------------------------------------------------------------
    def finished(self) -> tuple[Optional[set], Optional[set]]:
        sending = self.server.take_finished() if self.server is not None else set()
        recving = set()
        for rid, fut in list(self._inflight.items()):
            if fut.done():
                del self._inflight[rid]
                recving.add(rid)
                res = fut.result()
                if not res.ok:
                    with self._lock:
                        self._invalid |= res.invalid_blocks
        self._write_stats()
        return sending or None, recving or None

    def take_invalid(self) -> set[int]:
        with self._lock:
            bad, self._invalid = self._invalid, set()
        return bad

    def _write_stats(self) -> None:
        if self._stats_file:
            try:
                self.counters.write(self._stats_file, {
                    "kv_role": self.kv_role, "tp_rank": self.tp_rank, "pid": os.getpid(),
                    "side_channel": self.server.endpoint if self.server else ""})
            except OSError as e:
                log.warning("kvbridge stats file %s: %s", self._stats_file, e)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        self._write_stats()
        if self.store is not None:
            self.store.close()
        if self.engine is not None:
            self.engine.close()
