"""Shared fixtures of the Python suites. Run with the package on PYTHONPATH (build/python, as
`make test` does) or installed (`pip install .`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvbridge

REPO = Path(__file__).resolve().parents[2]


def need_cuda(ok: bool, reason: str) -> None:
    """Skips a GPU test where there is no usable GPU, naming why; with KVBRIDGE_REQUIRE_GPU=1
    (benchmarks/gpu_check.sh on a GPU machine) that is a failure instead."""
    if ok:
        return
    if os.environ.get("KVBRIDGE_REQUIRE_GPU") == "1":
        pytest.fail(f"KVBRIDGE_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster():
    with kvbridge.Cluster(nodes=3, dram_bytes_per_node=64 << 20, replica_num=1) as c:
        yield c


def python_env() -> dict:
    """Environment for child Python processes: same kvbridge as this process."""
    env = dict(os.environ)
    # Not resolve(): the build tree stages symlinks.
    pkg_parent = str(Path(os.path.abspath(kvbridge.__file__)).parent.parent)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    return env


def spawn_python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=python_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP a process and return once it is stopped. kill() returns before the signal takes
    effect, and a test that acts right after it can find the peer still answering."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} not stopped {timeout} s after SIGSTOP (state {state})")


def read_line(proc: subprocess.Popen, timeout: float = 20.0) -> bytes:
    """One stdout line of a child, or a failure showing its stderr."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline()
            if line:
                return line
            break
    proc.kill()
    raise AssertionError(f"child printed no line; stderr: {proc.stderr.read().decode()[-2000:]}")
