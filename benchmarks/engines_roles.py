"""Role script of `benchmarks/run engines` (benchmarks/bench_engines.py): one vLLM instance per
process, driven by a JSON plan, results as JSON lines on stdout.

    python engines_roles.py prefill '<plan json>'
    python engines_roles.py decode '<plan json>'

Common plan keys: "model", "llm" (extra LLM(...) keyword arguments), "kv_transfer_config".

``prefill``: "prompts" [{name, text}], "params" (kv_transfer_params per prompt), "done_file",
"reference_tokens" (0: none), "hold_s". Prefills every prompt (max_tokens 1) in one
``generate`` and prints {"event": "prefilled", "kv_transfer_params", "first_ids",
"prompt_lens", "seconds"}; then waits until the driver creates done_file; then, when
reference_tokens > 0, generates every prompt again without transfer parameters (a plain
instance's greedy ids, no KV moved) and prints {"event": "reference", "ids"}.

``decode``: "prompts" [{name, text}], "params_file" (a JSON list of kv_transfer_params, one
per prompt, waited for), "max_tokens". Sends the requests ONE AT A TIME through vLLM's
``LLMEngine`` (add_request + step), so that each request's KV transfer runs alone, and prints
per request {"event": "request", "name", "t_submit", "t_first", "t_done" (wall clock),
"ttft_s" (add_request to the first step output carrying a token), "ids", "prompt_len",
"num_cached_tokens", "finish_reason"}, then {"event": "done"}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def wait_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def which_mooncake() -> dict:
    """Which ``mooncake`` this interpreter imports: the real wheel ("mooncake"), kvbridge's
    drop-in ("kvbridge"), or none (null)."""
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return {"mooncake_impl": None, "mooncake_file": None}
    import mooncake
    return {"mooncake_impl": getattr(mooncake, "IMPLEMENTATION", "mooncake"),
            "mooncake_file": mooncake.__file__}


def make_llm(plan: dict):
    from vllm import LLM

    kw = dict(model=plan["model"], dtype="float32", enforce_eager=True, seed=0, block_size=32,
              enable_prefix_caching=False)
    kw.update(plan.get("llm") or {})
    if plan.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**plan["kv_transfer_config"])
    t0 = time.monotonic()
    llm = LLM(**kw)
    emit(event="ready", seconds=round(time.monotonic() - t0, 1), pid=os.getpid(),
         executable=sys.executable, **which_mooncake())
    return llm


def sampling(max_tokens: int, params):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra)


def run_prefill(plan: dict) -> None:
    llm = make_llm(plan)
    prompts = [p["text"] for p in plan["prompts"]]
    t = time.monotonic()
    outs = llm.generate(prompts, [sampling(1, p) for p in plan["params"]], use_tqdm=False)
    emit(event="prefilled", seconds=round(time.monotonic() - t, 3),
         kv_transfer_params=[o.kv_transfer_params for o in outs],
         first_ids=[list(o.outputs[0].token_ids) for o in outs],
         prompt_lens=[len(o.prompt_token_ids) for o in outs])
    wait_file(plan["done_file"], plan.get("hold_s", 900))
    n = plan.get("reference_tokens", 0)
    if n:
        t = time.monotonic()
        outs = llm.generate(prompts, [sampling(n, None)] * len(prompts), use_tqdm=False)
        emit(event="reference", seconds=round(time.monotonic() - t, 3),
             ids=[list(o.outputs[0].token_ids) for o in outs],
             num_cached_tokens=[o.num_cached_tokens for o in outs])
    emit(event="exit")


def run_decode(plan: dict) -> None:
    llm = make_llm(plan)
    engine = llm.llm_engine
    wait_file(plan["params_file"], plan.get("params_timeout", 900))
    with open(plan["params_file"]) as f:
        params = json.load(f)
    for i, (prompt, p) in enumerate(zip(plan["prompts"], params)):
        rid = f"bench-{i}-{prompt['name']}"
        t_submit = time.time()
        t0 = time.perf_counter()
        engine.add_request(rid, prompt["text"], sampling(plan["max_tokens"], p))
        ttft = t_first = None
        last = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                last = out
                if ttft is None and out.outputs and len(out.outputs[0].token_ids) > 0:
                    ttft = time.perf_counter() - t0
                    t_first = time.time()
        if last is None:
            raise RuntimeError(f"request {rid}: no output")
        o = last.outputs[0]
        emit(event="request", name=prompt["name"], t_submit=t_submit, t_first=t_first,
             t_done=time.time(), ttft_s=ttft, ids=list(o.token_ids),
             prompt_len=len(last.prompt_token_ids), num_cached_tokens=last.num_cached_tokens,
             finish_reason=o.finish_reason)
    emit(event="done")


if __name__ == "__main__":  # vLLM spawns its engine core: everything under the guard
    role, arg = sys.argv[1], json.loads(sys.argv[2])
    {"prefill": run_prefill, "decode": run_decode}[role](arg)
