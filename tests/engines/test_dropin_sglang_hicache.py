"""SGLang's stock Mooncake HiCache L3 backend (``--hicache-storage-backend mooncake``) on
kvbridge's Mooncake drop-in.

Nothing in SGLang's configuration names kvbridge: the backend is SGLang's own ``MooncakeStore``
(``sglang/srt/mem_cache/storage/mooncake_store``), its ``master_server_address`` is a kvbridge
master (a separate process with one storage node), and ``from mooncake.store import ...``
inside SGLang's scheduler finds the drop-in package (dropin/mooncake), installed by pip into an
overlay venv over .venv-engines. SGLang's host pool comes from the drop-in's
``MooncakeHostMemAllocator``; its pages go to the kvbridge node through
``batch_put_from``/``batch_get_into`` on registered memory.

Process A runs the prompts and writes their KV pages through; a fresh process B (new engine,
empty device and host caches) runs the same prompts. Asserted: B loaded prompt tokens from
storage (``cached_tokens_details["storage"] > 0``), B's token ids equal A's, and the kvbridge
master holds A's pages.

CPU-only box: tests/engines/cpu_sitecustomize (test-only) turns SGLang's cudaHostRegister of the
host pool into a no-op and gives the page_first_direct ``direct`` IO copies (imported from
sgl_kernel only on CUDA/ROCm) a torch version; Mooncake's backend needs a page-first host layout
for MHA models. About 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest

import dropin_roles
import harness

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    return dropin_roles.overlay_python(tmp_path_factory.mktemp("dropin") / "venv")


def test_sglang_hicache_mooncake_backend_on_dropin(overlay, log_dir):
    model = harness.tiny_llama()
    prompts = harness.prompts(2)
    script = dropin_roles.HERE / "dropin_roles.py"
    with harness.KvbridgeDaemons(log_dir, nodes=1, dram_bytes="256M") as cluster:
        common = {"model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS,
                  "master": cluster.address}

        def run(name: str, **more) -> dict:
            args = dict(common, name=name, **more)
            with harness.Role(name, ["timeout", "-k", "10", "300", overlay, script,
                                     "sglang-hicache", json.dumps(args)],
                              dropin_roles.overlay_env(), log_dir) as r:
                ready = r.wait_json(lambda d: d.get("event") == "ready", timeout=280)
                out = r.wait_json(lambda d: d.get("role") == name, timeout=240)
            assert ready["mooncake_impl"] == "kvbridge", ready
            return out

        a = run("writer", wait_for_store=True)
        stored = cluster.status()
        b = run("reader")

    assert a["store_objects"] and a["store_objects"] > 1, a
    assert stored["objects"] >= a["store_objects"] and stored["stored_bytes"] > 0, stored
    storage = [(d or {}).get("storage", 0) for d in b["cached_tokens_details"]]
    assert all(s > 0 for s in storage), b["cached_tokens_details"]
    assert b["ids"] == a["ids"], (a["ids"], b["ids"])
    print(f"\nSGLang HiCache mooncake backend on the drop-in: A wrote {a['store_objects']} "
          f"objects ({stored['stored_bytes']} bytes) to kvbridge; B storage hits {storage} "
          f"of prompt tokens {b['prompt_tokens']}; details {b['cached_tokens_details']}")
