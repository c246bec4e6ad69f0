"""The engine suites run only in the engines' venv (`make test-engines`, which creates it with
scripts/setup_engines_venv.sh); anywhere else they are skipped with the reason. With
KVBRIDGE_REQUIRE_ENGINES=1 (what `make` sets) a missing engine is an error, not a skip."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

_missing = [m for m in ("vllm", "sglang", "kvbridge") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config, items):
    if not _missing:
        return
    if os.environ.get("KVBRIDGE_REQUIRE_ENGINES") == "1":
        raise pytest.UsageError(f"tests/engines: {', '.join(_missing)} cannot be imported by "
                                f"{sys.executable} (KVBRIDGE_REQUIRE_ENGINES=1)")
    reason = (f"needs the engines' venv (missing: {', '.join(_missing)}); run `make test-engines`, "
              "which creates .venv-engines and puts the build's kvbridge on PYTHONPATH")
    for item in items:
        if "tests/engines" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def log_dir(request) -> Path:
    """Per-test directory for role logs under the build tree (kept after the run to read)."""
    import harness

    name = request.node.name.replace("/", "_").replace("[", "-").rstrip("]")
    d = harness.WORK_DIR / "logs" / name
    d.mkdir(parents=True, exist_ok=True)
    return d
