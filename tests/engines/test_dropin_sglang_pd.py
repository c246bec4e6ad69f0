"""SGLang's PD disaggregation with its stock ``mooncake`` transfer backend on kvbridge's Mooncake
drop-in.

SGLang's transfer backends are a fixed list (no plug-in point), so the drop-in is how kvbridge
gets under SGLang's PD path: two ``sgl.Engine`` processes with ``disaggregation_mode`` prefill
and decode, ``disaggregation_transfer_backend="mooncake"`` and ``MOONCAKE_PROTOCOL=tcp``;
``from mooncake.engine import TransferEngine`` inside SGLang's schedulers finds the drop-in
package (dropin/mooncake), installed by pip into an overlay venv over .venv-engines. The
prefill side's MooncakeKVManager pushes the prompt's KV pages and the aux (first token) data into
the decode side's pools with ``batch_transfer_sync_write`` over kvbridge's TCP transport.

Asserted: the decode side's greedy token ids equal a plain single instance's, every engine
ran the drop-in, and kvbridge's counters in the prefill process show at least the prompts' KV
bytes written.
"""

from __future__ import annotations

import json

import pytest

import dropin_roles
import harness

MAX_TOKENS = 8
# Tiny Llama: 2 layers x 2 KV heads x 32 dims, K and V, fp32.
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 4


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    return dropin_roles.overlay_python(tmp_path_factory.mktemp("dropin") / "venv")


def test_sglang_pd_mooncake_backend_on_dropin(overlay, log_dir, tmp_path):
    model = harness.tiny_llama()
    prompts = harness.prompts(2)
    common = {"model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS}
    script = dropin_roles.HERE / "dropin_roles.py"

    def role(name, kind, args, stats=None):
        env = dropin_roles.overlay_env({"MOONCAKE_PROTOCOL": "tcp"}, stats)
        return harness.Role(name, ["timeout", "-k", "10", "300", overlay, script, kind,
                                   json.dumps(args)], env, log_dir)

    with role("ref", "sglang-ref", common) as ref:
        reference = ref.wait_json(lambda d: d.get("role") == "ref", timeout=280)

    port = harness.free_port()
    stats = tmp_path / "stats"
    stats.mkdir()
    done = tmp_path / "decode-done"
    rooms = [1000 + i for i in range(len(prompts))]
    pd = dict(common, bootstrap_port=port, rooms=rooms, done_file=str(done))
    with role("prefill", "sglang-pd", dict(pd, mode="prefill"), stats) as p:
        p_ready = p.wait_json(lambda x: x.get("event") == "ready", timeout=280)
        with role("decode", "sglang-pd", dict(pd, mode="decode"), stats) as d:
            d_ready = d.wait_json(lambda x: x.get("event") == "ready", timeout=280)
            out = d.wait_json(lambda x: x.get("role") == "decode", timeout=240)
            p.wait_json(lambda x: x.get("role") == "prefill", timeout=60)
            done.write_text("ok")
        counters = dropin_roles.read_stats(stats)

    for ready in (p_ready, d_ready):
        assert ready["mooncake_impl"] == "kvbridge", ready
    assert out["ids"] == reference["ids"], (out["ids"], reference["ids"])
    writers = [c for c in counters if c["bytes_written"] > 0]
    assert writers, f"no kvbridge engine wrote bytes: {counters}"
    for c in counters:
        assert c["mooncake_impl"] == "kvbridge", c
    written = sum(c["bytes_written"] for c in writers)
    prompt_tokens = sum(m["prompt_tokens"] for m in out["meta"])
    assert written >= prompt_tokens * KV_BYTES_PER_TOKEN, (written, counters)
    print(f"\nSGLang PD on the drop-in: ids equal the single instance's; kvbridge "
          f"bytes_written={written} in {sum(c['calls'] for c in writers)} sync calls for "
          f"{prompt_tokens} prompt tokens; decode meta {out['meta']}")
