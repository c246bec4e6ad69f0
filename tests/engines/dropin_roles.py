"""Role scripts for the Mooncake drop-in tests (tests/engines/test_dropin_*.py), and the overlay
venv those roles run in.

The roles run the engines' stock Mooncake code paths: vLLM's in-tree ``MooncakeConnector``,
SGLang's ``--hicache-storage-backend mooncake`` and SGLang's PD ``mooncake`` transfer backend.
None of them names kvbridge: ``import mooncake`` in these processes finds kvbridge's drop-in
package (dropin/mooncake), installed by pip into an overlay venv over .venv-engines
(:func:`overlay_python`). Every role prints its results as one JSON line on stdout.

    python dropin_roles.py ROLE '<json args>'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DROPIN = REPO / "dropin" / "mooncake"
CPU_SITECUSTOMIZE = HERE / "cpu_sitecustomize"


# -- the overlay venv (used by the tests, not by the roles) -----------------------------------
def overlay_python(where: Path, base_python: str = sys.executable) -> Path:
    """A venv at `where` that sees every package of `base_python`'s environment (the engines'
    venv) through a .pth file, with the drop-in installed into it by pip (no dependencies, no
    network, no build isolation): its python is the engines' environment plus ``mooncake``,
    while .venv-engines itself stays free of ``mooncake``. Returns the overlay's python."""
    base_site = subprocess.run(
        [base_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_kvbridge_engines_venv.pth").write_text(base_site + "\n")
    # Build from a copy, so that setuptools leaves nothing in the source tree.
    src = where / "dropin-src"
    subprocess.run(["cp", "-r", str(DROPIN), str(src)], check=True)
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", str(src)],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"pip install of the drop-in failed:\n{proc.stderr[-3000:]}")
    return py


def overlay_env(extra: dict | None = None, stats_dir: Path | None = None) -> dict:
    """engine_env plus the test-only CPU patches (cpu_sitecustomize, active in every process
    the engines spawn) and, optionally, the directory kvbridge counters are written to."""
    import harness

    more = {"KVBRIDGE_TEST_CPU_PATCHES": "1"}
    if stats_dir is not None:
        more["KVBRIDGE_TEST_STATS_DIR"] = str(stats_dir)
    more.update(extra or {})
    return harness.engine_env(more, pythonpath=[CPU_SITECUSTOMIZE])


def read_stats(stats_dir: Path) -> list[dict]:
    out = []
    for p in sorted(stats_dir.glob("engine-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except ValueError:
            pass
    return out


# -- roles ------------------------------------------------------------------------------------
def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _which_mooncake() -> dict:
    import mooncake
    import mooncake.engine
    return {"mooncake_file": mooncake.__file__,
            "mooncake_impl": getattr(mooncake, "IMPLEMENTATION", None),
            "engine_class": f"{mooncake.engine.TransferEngine.__module__}."
                            f"{mooncake.engine.TransferEngine.__qualname__}",
            "executable": sys.executable}


def _vllm_llm(a: dict, kv_transfer_config: dict | None):
    from vllm import LLM

    kw = dict(model=a["model"], dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=4, seed=0, block_size=32, enable_prefix_caching=False)
    if kv_transfer_config is not None:
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    return LLM(**kw)


def _vllm_generate(llm, prompts: list, max_tokens: int, params: list | None):
    from vllm import SamplingParams

    sps = []
    for i in range(len(prompts)):
        extra = {"kv_transfer_params": params[i]} if params else None
        sps.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  extra_args=extra))
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [o.num_cached_tokens for o in outs],
            [len(o.prompt_token_ids) for o in outs])


def role_vllm_ref(a: dict) -> None:
    llm = _vllm_llm(a, None)
    ids, cached, plen = _vllm_generate(llm, a["prompts"], a["max_tokens"], None)
    emit(role="ref", ids=ids, num_cached_tokens=cached, prompt_lens=plen)


def _mooncake_connector(role: str, engine_id: str) -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def role_vllm_prefill(a: dict) -> None:
    """kv_producer: prefills with do_remote_decode, then keeps the blocks for the decode
    instance (its worker pushes them when decode asks) until `done_file` appears."""
    info = _which_mooncake()
    llm = _vllm_llm(a, _mooncake_connector("kv_producer", a["engine_id"]))
    emit(event="ready", **info)
    params = [{"do_remote_decode": True, "transfer_id": t} for t in a["transfer_ids"]]
    ids, cached, plen = _vllm_generate(llm, a["prompts"], 1, params)
    emit(event="prefilled", ids=ids, prompt_lens=plen)
    deadline = time.monotonic() + a.get("hold_s", 300)
    while not os.path.exists(a["done_file"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    emit(event="exit")


def role_vllm_decode(a: dict) -> None:
    info = _which_mooncake()
    llm = _vllm_llm(a, _mooncake_connector("kv_consumer", "decode-0"))
    emit(event="ready", **info)
    # As a router would: the decode request goes out once the prefill answered (the prefill
    # registers its engine with the bootstrap server as it starts, which may be later).
    deadline = time.monotonic() + a.get("go_wait_s", 280)
    while "go_file" in a and not os.path.exists(a["go_file"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    params = [{"do_remote_prefill": True, "remote_engine_id": a["remote_engine_id"],
               "remote_bootstrap_addr": a["remote_bootstrap_addr"], "transfer_id": t}
              for t in a["transfer_ids"]]
    t0 = time.monotonic()
    ids, cached, plen = _vllm_generate(llm, a["prompts"], a["max_tokens"], params)
    emit(role="decode", ids=ids, num_cached_tokens=cached, prompt_lens=plen,
         generate_s=round(time.monotonic() - t0, 3))


def _sglang_engine_kwargs(a: dict) -> dict:
    """sgl.Engine on CPU (torch_native attention, no CUDA graphs; SGLANG_USE_CPU_ENGINE unset,
    which would need the CPU build of sgl-kernel)."""
    return dict(model_path=a["model"], device="cpu", dtype="float32",
                attention_backend="torch_native", sampling_backend="pytorch",
                disable_cuda_graph=True, mem_fraction_static=0.05, max_total_tokens=4096,
                page_size=4, skip_server_warmup=True, random_seed=0,
                log_level=a.get("log_level", "info"))


def _sglang_generate(engine, prompts: list, max_tokens: int, **kw) -> list:
    outs = engine.generate(prompt=prompts, sampling_params={
        "temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}, **kw)
    return outs if isinstance(outs, list) else [outs]


def _wait_store_settled(master: str, quiet_s: float = 3.0, limit_s: float = 90.0) -> int:
    """The kvbridge master's object count once it has stopped growing for quiet_s."""
    import kvbridge

    deadline = time.monotonic() + limit_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = kvbridge.cluster_status(master)["objects"]
        if n != last:
            last, since = n, time.monotonic()
        elif n > 1 and time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.25)
    return last


def role_sglang_hicache(a: dict) -> None:
    """SGLang's stock Mooncake HiCache L3 backend (--hicache-storage-backend mooncake): the
    host pool comes from MooncakeHostMemAllocator, pages go through MooncakeDistributedStore
    to the kvbridge master named as Mooncake's master_server_address."""
    import sglang as sgl

    info = _which_mooncake()
    extra = {"master_server_address": a["master"], "protocol": "tcp",
             "metadata_server": "P2PHANDSHAKE", "global_segment_size": 0,
             "check_server": False, "prefetch_threshold": 8}
    engine = sgl.Engine(**_sglang_engine_kwargs(a), enable_hierarchical_cache=True,
                        hicache_ratio=2, hicache_io_backend="direct",
                        hicache_mem_layout="page_first_direct",
                        hicache_write_policy="write_through",
                        hicache_storage_prefetch_policy="wait_complete",
                        hicache_storage_backend="mooncake",
                        hicache_storage_backend_extra_config=json.dumps(extra))
    emit(event="ready", **info)
    outs = _sglang_generate(engine, a["prompts"], a["max_tokens"])
    objects = _wait_store_settled(a["master"]) if a.get("wait_for_store") else None
    emit(role=a["name"], ids=[o["output_ids"] for o in outs],
         cached_tokens=[o["meta_info"].get("cached_tokens") for o in outs],
         cached_tokens_details=[o["meta_info"].get("cached_tokens_details") for o in outs],
         prompt_tokens=[o["meta_info"].get("prompt_tokens") for o in outs],
         store_objects=objects)
    engine.shutdown()


def role_sglang_ref(a: dict) -> None:
    import sglang as sgl

    engine = sgl.Engine(**_sglang_engine_kwargs(a))
    outs = _sglang_generate(engine, a["prompts"], a["max_tokens"])
    emit(role="ref", ids=[o["output_ids"] for o in outs])
    engine.shutdown()


def role_sglang_pd(a: dict) -> None:
    """One side of SGLang's PD disaggregation with its stock ``mooncake`` transfer backend
    (MOONCAKE_PROTOCOL=tcp in the environment): ``a["mode"]`` is prefill or decode; both sides
    name the prefill side's bootstrap server and the same rooms."""
    import sglang as sgl

    info = _which_mooncake()
    engine = sgl.Engine(**_sglang_engine_kwargs(a), disaggregation_mode=a["mode"],
                        disaggregation_transfer_backend="mooncake",
                        disaggregation_bootstrap_port=a["bootstrap_port"])
    emit(event="ready", **info)
    n = len(a["prompts"])
    t0 = time.monotonic()
    outs = _sglang_generate(engine, a["prompts"], a["max_tokens"],
                            bootstrap_host=["127.0.0.1"] * n,
                            bootstrap_port=[a["bootstrap_port"]] * n,
                            bootstrap_room=a["rooms"])
    emit(role=a["mode"], ids=[o["output_ids"] for o in outs],
         meta=[{k: o["meta_info"].get(k) for k in ("prompt_tokens", "cached_tokens",
                                                   "finish_reason")} for o in outs],
         generate_s=round(time.monotonic() - t0, 3))
    if a["mode"] == "prefill":
        deadline = time.monotonic() + a.get("hold_s", 300)
        while not os.path.exists(a["done_file"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    engine.shutdown()


ROLES = {
    "sglang-ref": role_sglang_ref,
    "sglang-pd": role_sglang_pd,
    "sglang-hicache": role_sglang_hicache,
    "vllm-ref": role_vllm_ref,
    "vllm-prefill": role_vllm_prefill,
    "vllm-decode": role_vllm_decode,
}


if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
