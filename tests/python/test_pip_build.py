"""setup.py's behaviour before and around CMake: a missing system package is one line naming
the Debian package, and a configure that failed is redone, never trusted (tests call setup.py's
functions and pip itself; the full `pip install .` is scripts/check_pip_install.sh)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_setup_module():
    spec = importlib.util.spec_from_file_location("kvbridge_setup", REPO / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() itself runs only as __main__
    return mod


def restricted_path(tmp_path: Path, leave_out: str) -> str:
    """A PATH holding the build tools setup.py looks for, except `leave_out`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cmake", "ninja", "c++", "protoc", "grpc_cpp_plugin"):
        if tool != leave_out:
            os.symlink(shutil.which(tool), bin_dir / tool)
    return str(bin_dir)


@pytest.mark.parametrize("tool,package", [("protoc", "protobuf-compiler"),
                                          ("grpc_cpp_plugin", "protobuf-compiler-grpc"),
                                          ("ninja", "ninja-build")])
def test_pip_names_the_missing_package_in_one_line(tmp_path, tool, package):
    env = dict(os.environ, PATH=restricted_path(tmp_path, tool),
               KVBRIDGE_BUILD_DIR=str(tmp_path / "build"))
    env.pop("KVBRIDGE_SKIP_PREFLIGHT", None)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "--disable-pip-version-check", "-w", str(tmp_path / "wheel"), str(REPO)],
                       env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    line = next(ln for ln in out.splitlines() if "kvbridge: cannot build" in ln)
    assert f"`{tool}`" in line and package in line and "scripts/setup.sh" in line, line
    assert "CMake Error" not in out  # stopped before CMake
    assert not (tmp_path / "build" / "CMakeCache.txt").exists()


def test_missing_python_headers_are_named(monkeypatch, tmp_path):
    setup_py = load_setup_module()
    fake = dict(setup_py.sysconfig.get_paths(), include=str(tmp_path / "no-include"))
    monkeypatch.setattr(setup_py.sysconfig, "get_paths", lambda *a, **k: fake)
    with pytest.raises(SystemExit) as e:
        setup_py.check_build_dependencies()
    msg = str(e.value)
    assert "Python.h" in msg and "python3-dev" in msg and "scripts/setup.sh" in msg


def test_a_failed_configure_is_redone_not_trusted(monkeypatch, tmp_path):
    setup_py = load_setup_module()
    build_dir = tmp_path / "build"
    monkeypatch.setenv("KVBRIDGE_CUDA", "NOT-A-MODE")  # CMake refuses it: the configure fails
    with pytest.raises(SystemExit) as e:
        setup_py.configure(build_dir)
    assert "could not configure" in str(e.value) and "scripts/setup.sh" in str(e.value)
    assert (build_dir / "CMakeCache.txt").exists()  # what the failed run left
    assert not (build_dir / ".kvbridge-configured").exists()

    monkeypatch.setenv("KVBRIDGE_CUDA", "OFF")
    setup_py.configure(build_dir)
    assert (build_dir / "build.ninja").exists()
    cache = (build_dir / "CMakeCache.txt").read_text()
    assert "KVBRIDGE_CUDA:STRING=OFF" in cache
    # pybind11 is copied into the build tree: pip's isolated environment does not outlive it.
    assert re.search(rf"^pybind11_DIR:\w+={re.escape(str(build_dir))}/pybind11-", cache, re.M)

    # A configured tree with the same settings is not configured again.
    before = (build_dir / "CMakeCache.txt").stat().st_mtime_ns
    setup_py.configure(build_dir)
    assert (build_dir / "CMakeCache.txt").stat().st_mtime_ns == before
