"""Role scripts for tests/engines/test_vllm_connector.py: one vLLM instance (or one bare
kvbridge side-channel server) per process, driven by a JSON plan, results as JSON lines.

    python vllm_roles.py vllm '<plan json>'
    python vllm_roles.py pd-server '<json>'

``vllm`` plan: {"model", "kv_transfer_config" (or null), "steps": [...]}; steps run in order:

* {"op": "generate", "tag", "prompts": [...], "max_tokens", "params": [dict|null per prompt]
  | "params_file": path (a JSON list, waited for)} prints
  {"event": "generated", "tag", "token_ids", "num_cached_tokens", "finish_reason",
  "kv_transfer_params", "seconds"};
* {"op": "emit", ...} prints the rest of the step as a line (a marker for the driver);
* {"op": "wait_file", "path", "timeout"} waits until the driver creates the file;
* {"op": "serve"} stays alive (a prefill instance serving its blocks) until killed.

``pd-server``: a kvbridge TransferEngine with a fake packed-K|V cache ([blocks, heads,
block_size, 2*head]) filled with ``fill``, served by the connector's PdServer on
``port``; prints {"event": "ready", "endpoint", "node_id", "incarnation", "layout"} and lives
until killed. The connector's identity checks are tested against it without an engine.
"""

from __future__ import annotations

import json
import os
import sys
import time


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _wait_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def run_vllm(plan: dict) -> None:
    from vllm import LLM, SamplingParams

    kw = dict(model=plan["model"], dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=4, seed=0, block_size=32, enable_prefix_caching=False)
    if plan.get("kv_transfer_config"):
        kw["kv_transfer_config"] = plan["kv_transfer_config"]
    t0 = time.monotonic()
    llm = LLM(**kw)
    emit(event="ready", seconds=round(time.monotonic() - t0, 1), pid=os.getpid())
    for step in plan["steps"]:
        op = step["op"]
        if op == "emit":
            emit(**{k: v for k, v in step.items() if k != "op"})
        elif op == "wait_file":
            _wait_file(step["path"], step.get("timeout", 300))
        elif op == "serve":
            while True:
                time.sleep(3600)
        elif op == "generate":
            prompts = step["prompts"]
            params = step.get("params")
            if "params_file" in step:
                _wait_file(step["params_file"], step.get("timeout", 300))
                with open(step["params_file"]) as f:
                    params = json.load(f)
            params = params or [None] * len(prompts)
            sps = []
            for p in params:
                extra = {"kv_transfer_params": p} if p is not None else None
                sps.append(SamplingParams(temperature=0.0, max_tokens=step["max_tokens"],
                                          ignore_eos=True, extra_args=extra))
            t = time.monotonic()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            emit(event="generated", tag=step["tag"], seconds=round(time.monotonic() - t, 3),
                 token_ids=[list(o.outputs[0].token_ids) for o in outs],
                 prompt_lens=[len(o.prompt_token_ids) for o in outs],
                 num_cached_tokens=[o.num_cached_tokens for o in outs],
                 finish_reason=[o.outputs[0].finish_reason for o in outs],
                 kv_transfer_params=[o.kv_transfer_params for o in outs])
        else:
            raise ValueError(f"unknown step {op!r}")
    emit(event="done")


def run_pd_server(args: dict) -> None:
    import torch

    import kvbridge
    from kvbridge.integrations._vllm_core import Counters, layout_of
    from kvbridge.integrations._vllm_pd import PdServer

    blocks, heads, bs, hd = args.get("shape", [16, 2, 32, 64])
    kv = {f"layer.{i}": torch.full((blocks, heads, bs, 2 * hd), float(args["fill"]) + i)
          for i in range(args.get("layers", 2))}
    layout = layout_of(kv, blocks)
    eng = kvbridge.TransferEngine(node_id=args.get("node_id", f"pd-server-{os.getpid()}"),
                                  listen="127.0.0.1:0")
    segs = [(a, n, eng.register((a, n))) for a, n in layout.regions()]
    counters = Counters()
    server = PdServer(eng, layout, segs, "127.0.0.1", args.get("port", 0), counters)
    if args.get("hold"):
        server.hold(args["hold"])
    emit(event="ready", endpoint=server.endpoint, node_id=eng.id.node_id,
         incarnation=eng.id.incarnation, layout=layout.signature())
    while True:
        time.sleep(0.2)
        done = server.take_finished()
        if done:
            emit(event="finished", ids=sorted(done), counters=counters.snapshot())


if __name__ == "__main__":  # vLLM spawns its engine core: everything under the guard
    role, arg = sys.argv[1], json.loads(sys.argv[2])
    if role == "vllm":
        run_vllm(arg)
    elif role == "pd-server":
        run_pd_server(arg)
    else:
        raise SystemExit(f"unknown role {role!r}")
