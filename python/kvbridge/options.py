"""Keyword options, mirroring the ``KVBRIDGE_*`` environment variables.

Every class takes its options as keyword arguments named like the variable without the
``KVBRIDGE_`` prefix, lower-cased: ``KVBRIDGE_DEADLINE_MS`` is ``deadline_ms=``,
``KVBRIDGE_TCP_LANES_PER_PEER`` is ``tcp_lanes_per_peer=``. Defaults come from the variables
that are set, then the library's defaults; a keyword wins over the variable. Plugin settings
can also be given as ``plugin_config={"tcp.lanes_per_peer": "4"}``. docs/configuration.md lists
every option.
"""

from __future__ import annotations

from typing import Any

from kvbridge._native import _C
from kvbridge.errors import InvalidArgumentError

# Prefixes of plugin settings given as keywords: tcp_lanes_per_peer -> "tcp.lanes_per_peer".
PLUGIN_PREFIXES = ("tcp", "dram", "ssd", "ucx", "verbs", "nccl")

ENGINE_FIELDS = (
    "node_id", "transports", "plugin_path", "listen", "handshake_listen", "cluster_token",
    "deadline_ms",
    "progress_timeout_ms", "breaker_failures", "breaker_backoff_ms", "breaker_max_backoff_ms",
    "max_ops_per_batch", "max_inflight_batches", "max_unpolled_batches",
    "path_failover", "path_failover_writes", "failover_min_budget_ms", "local_copy",
    "local_copy_threads",
)
# Options that are booleans; every other bool is refused (True is not a number of ms).
BOOL_FIELDS = ("verify_checksums", "path_failover", "path_failover_writes", "local_copy",
               "metrics_listen_best_effort", "hard_pin")
STORE_FIELDS = ("master", "replica_num", "rpc_timeout_ms", "store_transfer_deadline_ms",
                "verify_checksums", "hedge_after_ms", "hedge_bandwidth_mbps",
                "location_cache_entries", "master_wait_ms", "hard_pin", "soft_pin",
                "soft_pin_ttl_ms", "peer_discovery", "admin_token", "client_faults")
NODE_FIELDS = ("master", "node_dram_bytes", "node_storage_plugin", "node_rpc_listen",
               "rpc_timeout_ms", "drain_timeout_ms", "node_ssd_path", "node_ssd_bytes",
               "node_ssd_plugin", "node_ssd_staging_bytes", "peer_discovery", "rpc_auth_skew_ms",
               "metrics_listen", "metrics_listen_best_effort", "metrics_token", "node_faults")
MASTER_FIELDS = ("master_listen", "node_ttl_ms", "lease_ms", "put_timeout_ms", "soft_pin_ttl_ms",
                 "min_replicas",
                 "high_watermark", "low_watermark", "demote_high_watermark",
                 "demote_low_watermark", "promote_after_reads", "drain_timeout_ms",
                 "rpc_timeout_ms", "task_timeout_ms", "departed_node_ttl_ms",
                 "max_departed_nodes", "max_departed_copies", "master_faults", "admin_token",
                 "rpc_auth_skew_ms", "metrics_listen", "metrics_listen_best_effort",
                 "metrics_token", "master_fast_port")
# A Master alone takes the cluster token as a master option; in a Cluster it is the engines'
# (cluster_token among ENGINE_FIELDS), which the embedded master uses too. The HA options too:
# a master of several electing a leader in etcd is the daemon (`kvbridge master --etcd ...`),
# and a Master given master_etcd says so (docs/ha.md).
MASTER_ONLY_FIELDS = ("cluster_token", "master_etcd", "master_advertise", "ha_lease_ms",
                      "ha_takeover_wait_ms")


def _set(obj: Any, name: str, value: Any) -> None:
    if name == "transports" and isinstance(value, str):
        value = [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, bool) and name not in BOOL_FIELDS:
        raise InvalidArgumentError(f"option {name}={value!r}: expected a number or string")
    try:
        setattr(obj, name, value)
    except TypeError:
        expected = type(getattr(obj, name)).__name__
        if expected == "int":
            expected = "a non-negative int"
        raise InvalidArgumentError(
            f"option {name}={value!r}: expected {expected}") from None


def _apply(obj: Any, fields: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    for name in fields:
        if name in kwargs:
            _set(obj, name, kwargs.pop(name))


def engine_options(kwargs: dict[str, Any], base: Any = None) -> Any:
    """Pops engine options (and plugin settings) from kwargs into an _C.EngineOptions."""
    opts = base if base is not None else _C.EngineOptions.from_env()
    _apply(opts, ENGINE_FIELDS, kwargs)
    config = dict(opts.plugin_config)
    extra = kwargs.pop("plugin_config", None) or {}
    if not isinstance(extra, dict):
        raise InvalidArgumentError("option plugin_config: expected a dict of 'plugin.key': value")
    for key, value in extra.items():
        if "." not in key:
            raise InvalidArgumentError(
                f"plugin_config key {key!r}: expected '<plugin>.<key>', e.g. 'tcp.lanes_per_peer'")
        config[key] = str(value)
    for name in [k for k in kwargs if k.split("_", 1)[0] in PLUGIN_PREFIXES and "_" in k]:
        plugin, key = name.split("_", 1)
        value = kwargs.pop(name)
        config[f"{plugin}.{key}"] = str(int(value)) if isinstance(value, bool) else str(value)
    opts.plugin_config = config  # a copy crosses the binding: assign the whole map
    return opts


def check_consumed(kwargs: dict[str, Any], what: str, known: tuple[str, ...]) -> None:
    """TypeError for keywords nobody used (a typo must not be silently ignored)."""
    if kwargs:
        names = ", ".join(sorted(kwargs))
        raise TypeError(
            f"{what}: unknown option(s) {names}; known: {', '.join(sorted(set(known)))}, "
            f"plugin settings as <plugin>_<key> ({', '.join(PLUGIN_PREFIXES)}) or plugin_config")


def store_options(kwargs: dict[str, Any]) -> Any:
    opts = _C.StoreOptions.from_env()
    _apply(opts, STORE_FIELDS, kwargs)
    opts.engine = engine_options(kwargs, opts.engine)
    return opts


def node_options(kwargs: dict[str, Any]) -> Any:
    opts = _C.NodeOptions.from_env()
    _apply(opts, NODE_FIELDS, kwargs)
    opts.engine = engine_options(kwargs, opts.engine)
    return opts


def master_options(kwargs: dict[str, Any], base: Any = None, alone: bool = False) -> Any:
    """Pops master options from kwargs; `alone`: a Master of its own (takes cluster_token)."""
    opts = base if base is not None else _C.MasterOptions.from_env()
    _apply(opts, MASTER_FIELDS + (MASTER_ONLY_FIELDS if alone else ()), kwargs)
    return opts
