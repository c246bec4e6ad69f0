"""What the end-to-end tests with the real engines share (tests/engines/).

They run under the engines' venv (.venv-engines, scripts/setup_engines_venv.sh) with the
kvbridge build tree's package on PYTHONPATH, and start every engine role and every kvbridge
daemon as its own process group, killed as a group when the test ends: vLLM and SGLang leave
engine-core, worker and scheduler children behind that otherwise keep ports and memory.

Nothing here downloads: the model is a tiny random Llama with a tokenizer trained on the spot
(:func:`tiny_llama`), cached under the build tree between runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("KVBRIDGE_BUILD_DIR") or ROOT / "build").resolve()
KVBRIDGE_PYTHONPATH = BUILD_DIR / "python"
HERE = Path(__file__).resolve().parent
# Where tiny models and role logs go; the build tree is git-ignored.
WORK_DIR = Path(os.environ.get("KVBRIDGE_ENGINES_WORK") or BUILD_DIR / "engines").resolve()

WORDS = ("the quick brown fox jumps over a lazy dog while seven red birds sing about cold "
         "winter nights and warm summer days near old stone bridges under bright blue skies"
         ).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(extra: Optional[dict] = None, pythonpath: Iterable[os.PathLike] = ()) -> dict:
    """Environment for an engine role: kvbridge from the build tree (after `pythonpath`, e.g. a
    directory of test-only shims), no hub access, one KV-cache GiB for vLLM on CPU."""
    env = dict(os.environ)
    paths = [str(p) for p in pythonpath] + [str(KVBRIDGE_PYTHONPATH), str(HERE)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def prompts(count: int = 2, first_len: int = 110, step: int = -28) -> list[str]:
    """Deterministic prompts of first_len, first_len+step, ... words from the tiny vocabulary."""
    out = []
    for i in range(count):
        n = first_len + i * step
        out.append(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)))
    return out


def tiny_llama(layers: int = 2, kv_heads: int = 2, heads: int = 2, head_dim: int = 32,
               hidden: int = 64, seed: int = 0) -> Path:
    """A random Llama and a WordLevel tokenizer over WORDS, saved with save_pretrained (built once
    per shape, then reused). vocab_size equals the tokenizer's length, as the engines require."""
    name = f"tiny-llama-L{layers}-kv{kv_heads}-h{heads}-d{head_dim}-H{hidden}-s{seed}"
    path = WORK_DIR / "models" / name
    if (path / ".complete").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path)
    (path / ".complete").write_text("ok\n")
    return path


class Role:
    """A child process in its own process group, stdout/stderr to files under the log dir.
    ``with Role(...) as r:`` kills the whole group on exit; JSON lines on stdout are results."""

    def __init__(self, name: str, argv: list, env: dict, log_dir: Path, cwd: Optional[Path] = None):
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = log_dir / f"{name}.out"
        self.err_path = log_dir / f"{name}.err"
        self._out = open(self.out_path, "wb")
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([str(a) for a in argv], env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL,
                                     stdout=self._out, stderr=self._err, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def json_lines(self) -> list[dict]:
        out = []
        for line in self.out_path.read_text(errors="replace").splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait_json(self, predicate=lambda d: True, timeout: float = 120.0) -> dict:
        """The first JSON line on stdout that satisfies predicate; fails (with the tail of
        stderr) if the process exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            for d in self.json_lines():
                if predicate(d):
                    return d
            if self.proc.poll() is not None:
                for d in self.json_lines():  # printed just before exiting
                    if predicate(d):
                        return d
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} before the "
                                     f"expected line; stderr tail:\n{self.stderr_tail()}")
            if time.monotonic() > deadline:
                stacks = self.dump_stacks()
                raise AssertionError(f"{self.name}: no expected line within {timeout:.0f} s; "
                                     f"stderr tail:\n{self.stderr_tail(1500)}\n{stacks}")
            time.sleep(0.2)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout:.0f} s; stderr tail:\n"
                                 f"{self.stderr_tail()}") from None

    def group_pids(self) -> list[int]:
        """The live processes of this role's process group (the leader and what it started)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getpgid(int(entry.name)) == self.proc.pid:
                        pids.append(int(entry.name))
                except (ProcessLookupError, PermissionError):
                    pass
        return sorted(pids)

    def dump_stacks(self, chars: int = 6000) -> str:
        """Python and native stacks of every process of the group (py-spy, from the engines'
        venv), written to <name>.stacks in the log dir; returns a summary of what each process'
        threads were doing (the last frames, to `chars`). For a role that stops answering:
        which process and thread it waits in."""
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            return f"(no stacks: {spy} is missing)"
        dumps = []
        for pid in self.group_pids():
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                state, utime, stime = stat[0], int(stat[11]), int(stat[12])
            except OSError:
                continue
            tick = os.sysconf("SC_CLK_TCK")
            head = f"--- pid {pid} {comm} state {state} cpu {(utime + stime) / tick:.1f} s"
            try:
                r = subprocess.run([str(spy), "dump", "--native", "--pid", str(pid)],
                                   capture_output=True, text=True, timeout=60)
                dumps.append(f"{head}\n{r.stdout}{r.stderr}")
            except subprocess.TimeoutExpired:
                dumps.append(f"{head}\n(py-spy took over 60 s)")
        text = "\n".join(dumps)
        (self.out_path.parent / f"{self.name}.stacks").write_text(text)
        # The summary: per thread, its header and the innermost frames that name a function.
        lines, keep = [], 0
        for line in text.splitlines():
            if line.startswith("---") or line.startswith("Thread "):
                lines.append(line)
                keep = 4
            elif keep and line.strip():
                lines.append(line)
                keep -= 1
        summary = "\n".join(lines)
        return f"stacks ({self.out_path.parent / (self.name + '.stacks')}):\n{summary[-chars:]}"

    def stderr_tail(self, chars: int = 4000) -> str:
        self._err.flush()
        return self.err_path.read_text(errors="replace")[-chars:]

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole group (also children the role's leader left behind)."""
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        self._err.close()

    def __enter__(self) -> "Role":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def python_role(name: str, script: Path, args: Iterable, env: dict, log_dir: Path) -> Role:
    """Runs `script` with this interpreter (the engines' venv) as a Role."""
    return Role(name, [sys.executable, script, *args], env, log_dir)


class KvbridgeDaemons:
    """A kvbridge master and storage nodes as processes (`python -m kvbridge master|node`),
    each in its own process group, for tests that kill or freeze one."""

    def __init__(self, log_dir: Path, nodes: int = 1, dram_bytes: str = "256M",
                 node_ttl_ms: int = 3000):
        self.log_dir = log_dir
        self.roles: list[Role] = []
        self.env = engine_env()
        port = free_port()
        self.master = self._start("master", ["master", "--listen", f"127.0.0.1:{port}",
                                              "--node-ttl-ms", str(node_ttl_ms)])
        self.address = self.master.wait_json(lambda d: d.get("event") == "ready", 60)["address"]
        self.nodes = [self.add_node(f"node{i}", dram_bytes) for i in range(nodes)]

    def _start(self, name: str, args: list) -> Role:
        role = Role(name, [sys.executable, "-m", "kvbridge", *args, "--json"], self.env,
                    self.log_dir)
        self.roles.append(role)
        return role

    def add_node(self, name: str, dram_bytes: str = "256M") -> Role:
        role = self._start(name, ["node", "--master", self.address, "--dram-bytes", dram_bytes,
                                  "--node-id", name, "--listen", "127.0.0.1:0"])
        role.wait_json(lambda d: d.get("event") == "ready", 60)
        return role

    def status(self) -> dict:
        import kvbridge
        return kvbridge.cluster_status(self.address)

    def close(self) -> None:
        for r in reversed(self.roles):
            r.kill()

    def __enter__(self) -> "KvbridgeDaemons":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
