"""The options are defined in several places that must agree: the C++ structs and their
FromEnv() (csrc/include/kvbridge/{options,store}.h), the bindings (csrc/bindings), the Python
keywords (python/kvbridge/options.py), the daemon's flags (csrc/tools/kvbridge_main.cc) and the
tables of docs/configuration.md. These tests take the tables as the reference and check the
others against them by behaviour: a variable set in a child's environment must show up in the
bound attribute FromEnv() filled, a documented flag must be taken by the daemon, a documented
number must be the bound default.

Naming: an option's Python keyword (and bound attribute) is its variable without KVBRIDGE_,
lower-cased (KVBRIDGE_MASTER_LISTEN is master_listen=); an option without a variable keeps
the name in the table's option column.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import python_env
from kvbridge import options as kvb_options
from kvbridge._native import _C

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Table heading (its start) -> the bound options class, the Python keywords, the daemon command.
SECTIONS = {
    "Engine": ("EngineOptions", kvb_options.ENGINE_FIELDS + ("plugin_config",), None),
    "Master": ("MasterOptions", kvb_options.MASTER_FIELDS + kvb_options.MASTER_ONLY_FIELDS,
               "master"),
    "Storage node": ("NodeOptions", kvb_options.NODE_FIELDS, "node"),
    "Client": ("StoreOptions", kvb_options.STORE_FIELDS, None),
}
# Bound attributes that are not options of their own: the nested engine's options (its table).
NESTED = {"engine"}
# Variables in the tables that FromEnv() does not read, and why.
NOT_FROM_ENV = {
    "KVBRIDGE_PLUGIN_PATH": "read by the plugin loader",
    "KVBRIDGE_LOG_LEVEL": "read by the logger",
    "KVBRIDGE_CLIENT_METRICS_LISTEN": "read by the Python StoreClient (kvbridge.metrics)",
    "KVBRIDGE_VERIFY_CHECKSUMS": "accepted and ignored",
    "KVBRIDGE_MASTER_FAST_PATH": "read by every MasterClient of the process",
}
# Flags of a command that set no option.
COMMAND_FLAGS = {"config", "json", "help"}


@dataclass
class Row:
    options: list[str]  # C++ names; "engine.x" is the nested engine's x
    variables: list[str]
    flags: list[str]
    defaults: list[str]

    def attrs(self) -> list[tuple[str, str]]:
        """(path of the bound attribute, variable or "") for each option of the row."""
        out = []
        for i, opt in enumerate(self.options):
            var = self.variables[i] if i < len(self.variables) else ""
            name = var[len("KVBRIDGE_"):].lower() if var else opt.split(".")[-1]
            out.append(("engine." + name if opt.startswith("engine.") else name, var))
        return out


@dataclass
class Section:
    cls: str
    keywords: tuple[str, ...]
    command: str | None
    rows: list[Row] = field(default_factory=list)


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell) if cell.strip() != "—" else []


def parse_doc() -> dict[str, Section]:
    sections: dict[str, Section] = {}
    current: Section | None = None
    header: list[str] = []
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            current = None
            for start, (cls, keywords, command) in SECTIONS.items():
                if title.startswith(start):
                    current = sections[start] = Section(cls, keywords, command)
            header = []
            continue
        if current is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not header:
            header = cells
            continue
        if set(cells[0]) <= {"-", ":"}:
            continue
        col = dict(zip(header, cells))
        if "Python" in col["option"]:  # a Python-only option, not in the C++ struct
            continue
        default = re.sub(r"\s*\([^)]*\)", "", col.get("default", ""))
        current.rows.append(Row(_names(col["option"]), _names(col.get("variable", "—")),
                                [f.lstrip("-") for f in _names(col.get("flag", "—"))],
                                [d.strip() for d in default.split(",")]))
    assert set(sections) == set(SECTIONS), f"{DOC}: sections {sorted(sections)}"
    return sections


DOCS = parse_doc()


def _bound(cls: str) -> list[str]:
    t = getattr(_C, cls)
    return sorted(n for n in dir(t) if isinstance(getattr(t, n, None), property))


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _distinct(default, i: int):
    """A value for a variable unlike the default and unlike the other variables' values:
    (the text to set, the value FromEnv must read)."""
    if isinstance(default, bool):
        return ("0", False) if default else ("1", True)
    if isinstance(default, int):
        v = 7919 + 13 * i
        return str(v), v
    if isinstance(default, float):
        v = 0.5 + i / 1024
        return repr(v), v
    if isinstance(default, list):
        return f"tcp,drift{i}", ["tcp", f"drift{i}"]
    return f"drift-{i}", f"drift-{i}"


@pytest.mark.parametrize("title", sorted(SECTIONS))
def test_every_documented_variable_is_read_into_its_bound_attribute(title):
    sec = DOCS[title]
    defaults = getattr(_C, sec.cls)()
    env = {k: v for k, v in python_env().items() if not k.startswith("KVBRIDGE_")}
    expect, ignored, values = {}, {}, {}
    for row in sec.rows:
        for path, var in row.attrs():
            if not var or var in NOT_FROM_ENV and var != "KVBRIDGE_VERIFY_CHECKSUMS":
                continue
            if not _has(defaults, path):
                pytest.fail(f"{title}: {var} is documented, but {sec.cls} binds no `{path}`")
            if var not in values:  # a variable in two rows has one value
                values[var] = _distinct(_get(defaults, path), len(values))
            env[var] = values[var][0]
            if var in NOT_FROM_ENV:
                ignored[path] = _get(defaults, path)
            else:
                expect[path] = (var, values[var][1])
    code = ("import json, sys\nfrom kvbridge._native import _C\n"
            f"o = _C.{sec.cls}.from_env()\n"
            "def get(p):\n    v = o\n    for a in p.split('.'):\n        v = getattr(v, a)\n"
            "    return v\n"
            "print(json.dumps({p: get(p) for p in sys.argv[1:]}))\n")
    r = subprocess.run([sys.executable, "-c", code, *expect, *ignored], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    wrong = {p: f"{var}={env[var]} read as {got[p]!r}" for p, (var, v) in expect.items()
             if not (got[p] == v or isinstance(v, float) and abs(got[p] - v) < 1e-9)}
    assert not wrong, f"{sec.cls}.from_env(): {wrong}"
    assert {p: got[p] for p in ignored} == ignored


def _has(obj, path: str) -> bool:
    try:
        _get(obj, path)
        return True
    except AttributeError:
        return False


@pytest.mark.parametrize("title", sorted(SECTIONS))
def test_every_bound_option_is_documented_and_a_python_keyword(title):
    sec = DOCS[title]
    documented = {path for row in sec.rows for path, _ in row.attrs()}
    bound = set(_bound(sec.cls)) - NESTED
    assert not bound - documented, (
        f"{sec.cls} binds options docs/configuration.md's {title} table does not list")
    assert not bound - set(sec.keywords), (
        f"{sec.cls} binds options no Python keyword sets (python/kvbridge/options.py)")
    assert not set(sec.keywords) - bound - {"plugin_config"}, (
        f"python/kvbridge/options.py names keywords {sec.cls} does not bind")


def _daemon_flags(command: str) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "kvbridge", command, "--help"], env=python_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"^\s+--([a-z][a-z0-9-]*)", r.stdout, re.MULTILINE))


@pytest.mark.parametrize("title", [t for t, (_, _, cmd) in SECTIONS.items() if cmd])
def test_documented_flags_are_the_daemons(title):
    sec = DOCS[title]
    documented = {f for row in sec.rows for f in row.flags}
    listed = _daemon_flags(sec.command) - COMMAND_FLAGS
    assert documented == listed, (
        f"kvbridge {sec.command}: flags only in docs/configuration.md: "
        f"{sorted(documented - listed)}, only in the daemon's --help: "
        f"{sorted(listed - documented)}")
    # And it takes them all (a flag it did not know would be a usage error, exit 2).
    args = [a for f in sorted(documented) for a in (f"--{f}", "1")]
    r = subprocess.run([sys.executable, "-m", "kvbridge", sec.command, *args, "--help"],
                       env=python_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


_SIZE = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _doc_value(text: str, bound):
    """The documented default as a value comparable with the bound one; None: not checkable
    (a placeholder, prose, another option's name)."""
    text = text.strip()
    if isinstance(bound, bool):
        return {"on": True, "true": True, "off": False, "false": False}.get(text)
    if isinstance(bound, (int, float)):
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(?: (KiB|MiB|GiB))?", text)
        if not m:
            return None
        return float(m.group(1)) * _SIZE.get(m.group(2) or "", 1)
    if isinstance(bound, str):
        if text.startswith("empty"):
            return ""
        m = re.fullmatch(r"`([^`<]+)`", text)
        return m.group(1) if m else None
    return None


@pytest.mark.parametrize("title", sorted(SECTIONS))
def test_documented_defaults_are_the_bound_defaults(title):
    sec = DOCS[title]
    defaults = getattr(_C, sec.cls)()
    option_names = {o for row in sec.rows for o in row.options}
    checked, wrong = 0, {}
    for row in sec.rows:
        for (path, _), text in zip(row.attrs(), row.defaults):
            if not _has(defaults, path) or text.strip("` ") in option_names:
                continue
            bound = _get(defaults, path)
            doc = _doc_value(text, bound)
            if doc is None:
                continue
            checked += 1
            if doc != bound:
                wrong[path] = f"documented {text!r}, bound default {bound!r}"
    assert not wrong, f"docs/configuration.md {title} vs {sec.cls}(): {wrong}"
    assert checked >= 3, f"{title}: only {checked} defaults could be read from the table"


def test_master_takes_the_master_keywords_and_sends_ha_to_the_daemon():
    import kvbridge
    from kvbridge.errors import InvalidArgumentError

    with kvbridge.Master(master_listen="127.0.0.1:0", task_timeout_ms=12000,
                         departed_node_ttl_ms=60000, max_departed_nodes=16,
                         max_departed_copies=1024, master_faults="", ha_lease_ms=4000) as m:
        assert m.address.startswith("127.0.0.1:")
    with pytest.raises(InvalidArgumentError, match="kvbridge master --etcd"):
        kvbridge.Master(master_listen="127.0.0.1:0", master_etcd="127.0.0.1:2379")


@pytest.mark.parametrize("cls,var,attr,bad", [
    ("EngineOptions", "KVBRIDGE_DEADLINE_MS", "deadline_ms", "10s"),
    ("EngineOptions", "KVBRIDGE_PATH_FAILOVER", "path_failover", "yes"),
    ("MasterOptions", "KVBRIDGE_NODE_TTL_MS", "node_ttl_ms", "4294967296"),
    ("MasterOptions", "KVBRIDGE_HIGH_WATERMARK", "high_watermark", "90%"),
    ("NodeOptions", "KVBRIDGE_NODE_DRAM_BYTES", "node_dram_bytes", "64G"),
    ("StoreOptions", "KVBRIDGE_REPLICA_NUM", "replica_num", "-1"),
])
def test_a_malformed_value_is_ignored_with_a_warning_naming_it(cls, var, attr, bad):
    env = {k: v for k, v in python_env().items() if not k.startswith("KVBRIDGE_")}
    env[var] = bad
    code = (f"from kvbridge._native import _C\n"
            f"print(getattr(_C.{cls}.from_env(), {attr!r}) == getattr(_C.{cls}(), {attr!r}))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"  # the default kept
    assert f"ignoring {var}='{bad}'" in r.stderr
