"""vLLM's stock ``MooncakeConnector`` (PD disaggregation) on kvbridge's Mooncake drop-in.

No kvbridge name appears in vLLM's configuration: the connector is vLLM's in-tree
``MooncakeConnector`` with ``mooncake_protocol: tcp``, and ``from mooncake.engine import
TransferEngine`` inside vLLM's worker finds the drop-in package (dropin/mooncake), installed by
pip into an overlay venv over .venv-engines. A prefill instance (kv_producer) and a decode
instance (kv_consumer) run concurrently; the prefill worker pushes the prompt's KV blocks into
the decode worker's KV cache over kvbridge's TCP transport.

Asserted: the decode instance took the whole prompt from the remote side (num_cached_tokens ==
prompt length), its greedy token ids equal a single instance's, every engine process ran the
drop-in (the overlay's python, kvbridge's TransferEngine), and kvbridge's transport counters in
the prefill worker show at least the prompt's KV bytes written.

CPU-only box: vLLM's worker asks ``torch.accelerator.current_device_index()``, which PyPI's torch
(a CUDA build) refuses without a driver; tests/engines/cpu_sitecustomize patches that in every
spawned process (test-only). About 1.5-2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import sys

import pytest

import dropin_roles
import harness

MAX_TOKENS = 12
# Tiny Llama (harness.tiny_llama defaults): 2 layers x 2 KV heads x 32 dims, K and V, fp32.
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 4


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    """The overlay venv's python, with the drop-in installed by pip."""
    return dropin_roles.overlay_python(tmp_path_factory.mktemp("dropin") / "venv")


def test_installed_dropin_is_what_import_mooncake_finds(overlay):
    import subprocess

    env = dropin_roles.overlay_env()
    out = subprocess.run([overlay, "-c", "import json, dropin_roles; "
                          "print(json.dumps(dropin_roles._which_mooncake()))"],
                         env=env, capture_output=True, text=True, timeout=120,
                         cwd=dropin_roles.HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["mooncake_impl"] == "kvbridge"
    assert info["mooncake_file"].startswith(str(overlay.parent.parent))
    assert info["engine_class"] == "kvbridge.compat._mooncake_engine.TransferEngine"
    # .venv-engines itself stays free of mooncake.
    base = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                           "print(u.find_spec('mooncake'))"], capture_output=True, text=True,
                          env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert base.stdout.strip() == "None"


def test_vllm_pd_through_stock_mooncake_connector(overlay, log_dir, tmp_path):
    model = harness.tiny_llama()
    prompts = harness.prompts(2)
    common = {"model": str(model), "prompts": prompts, "max_tokens": MAX_TOKENS}
    script = dropin_roles.HERE / "dropin_roles.py"

    def role(name, kind, args, extra=None, stats=None):
        env = dropin_roles.overlay_env(extra, stats)
        return harness.Role(name, ["timeout", "-k", "10", "300", overlay, script, kind,
                                   json.dumps(args)], env, log_dir)

    # Reference: one plain instance, no connector.
    with role("ref", "vllm-ref", common) as ref:
        reference = ref.wait_json(lambda d: d.get("role") == "ref", timeout=280)

    port = harness.free_port()
    stats = tmp_path / "stats"
    stats.mkdir()
    done = tmp_path / "decode-done"
    go = tmp_path / "prefilled"
    xfer = [f"dropin-xfer-{i}" for i in range(len(prompts))]
    net = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}
    with role("prefill", "vllm-prefill",
              dict(common, engine_id="prefill-0", transfer_ids=xfer, done_file=str(done)),
              dict(net, VLLM_CPU_OMP_THREADS_BIND="0"), stats) as p, \
         role("decode", "vllm-decode",
              dict(common, remote_engine_id="prefill-0", transfer_ids=xfer,
                   remote_bootstrap_addr=f"http://127.0.0.1:{port}", go_file=str(go)),
              dict(net, VLLM_CPU_OMP_THREADS_BIND="1"), stats) as d:
        p_ready = p.wait_json(lambda x: x.get("event") == "ready", timeout=280)
        d_ready = d.wait_json(lambda x: x.get("event") == "ready", timeout=280)
        # The decode's requests go out after the prefill answered, as a router sends them.
        p.wait_json(lambda x: x.get("event") == "prefilled", timeout=120)
        go.write_text("ok")
        out = d.wait_json(lambda x: x.get("role") == "decode", timeout=240)
        done.write_text("ok")
        counters = dropin_roles.read_stats(stats)

    for ready in (p_ready, d_ready):
        assert ready["mooncake_impl"] == "kvbridge", ready
        assert ready["executable"].startswith(str(overlay.parent.parent)), ready
    assert out["prompt_lens"] == reference["prompt_lens"]
    # The decode instance computed none of the prompt itself.
    assert out["num_cached_tokens"] == out["prompt_lens"], out
    assert out["ids"] == reference["ids"], (out["ids"], reference["ids"])
    # kvbridge moved the KV: the prefill worker's engine wrote at least the prompt's bytes.
    writers = [c for c in counters if c["bytes_written"] > 0]
    assert writers, f"no kvbridge engine wrote bytes: {counters}"
    for c in counters:  # every Mooncake engine in the engines' workers was the drop-in's
        assert c["mooncake_impl"] == "kvbridge" and c["executable"].startswith(
            str(overlay.parent.parent)), c
    written = sum(c["bytes_written"] for c in writers)
    assert written >= sum(out["num_cached_tokens"]) * KV_BYTES_PER_TOKEN, (written, counters)
    print(f"\nvLLM PD on the drop-in: num_cached_tokens={out['num_cached_tokens']}, "
          f"kvbridge bytes_written={written} in {sum(c['calls'] for c in writers)} sync calls, "
          f"decode generate {out['generate_s']} s")
