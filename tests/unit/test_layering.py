"""The package's seams, read from its source: which part may import which, no import cycles, and
no mode compared as a bare string outside its enum's module."""

from __future__ import annotations

import ast
import enum
import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_gspo"
# parts that must stay free of the Megatron side (model/, train/)
MEGATRON_FREE = ("algo", "hf", "server", "rollout")
MODE_ENUMS = {  # every mode's enum, by the module that owns it
    "megatron_gspo.algo.config": (
        "LossKind",
        "Agg",
        "AdvNorm",
        "Mismatch",
        "Level",
        "KLEstimator",
    ),
    "megatron_gspo.routing.modes": ("ReplayMode",),
    "megatron_gspo.weight_sync.config": ("SyncMethod",),
    "megatron_gspo.rollout.modes": ("Backend", "Placement"),
    "megatron_gspo.model.optim": ("Decay",),
    "megatron_gspo.model.modes": ("Recompute",),  # GroupedGemm: "auto" is also the server's
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every megatron_gspo module `name` imports, at any depth of its code (function-level and
    TYPE_CHECKING imports count: a cycle through them is still a cycle of the design)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _part(module: str) -> str:
    """The package directly under megatron_gspo (or the top-level module itself)."""
    return module.split(".")[1] if module.count(".") else module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_or_inside_packages():
    graph = _graph()
    assert _cycles(graph) == [], "modules importing each other in a circle"
    parts: dict[str, set[str]] = {}
    for module, deps in graph.items():
        for dep in deps:
            if _part(dep) != _part(module) and _part(dep) != "megatron_gspo":
                parts.setdefault(_part(module), set()).add(_part(dep))
    assert _cycles(parts) == [], f"packages importing each other in a circle: {parts}"


def test_the_megatron_free_parts_and_config_import_no_model_or_train():
    graph = _graph()
    bad = sorted(
        (module, dep)
        for module, deps in graph.items()
        if _part(module) in MEGATRON_FREE
        for dep in deps
        if _part(dep) in ("model", "train")
    )
    assert bad == []
    assert not [d for d in graph["megatron_gspo.config"] if _part(d) == "train"]


def _mode_values() -> dict[str, str]:
    """Each mode's string value -> the module that owns its enum."""
    owner = {}
    for module, names in MODE_ENUMS.items():
        for name in names:
            enum_cls = getattr(importlib.import_module(module), name)
            assert issubclass(enum_cls, enum.StrEnum)
            owner.update({member.value: module for member in enum_cls})
    return owner


def _literal_mode_comparisons(text: str, values) -> list[str]:
    alts = "|".join(re.escape(v) for v in values)
    compared = re.compile(rf"""(==|!=)\s*["']({alts})["']|["']({alts})["']\s*(==|!=)""")
    return [line.strip() for line in text.splitlines() if compared.search(line)]


def test_the_mode_grep_catches_a_literal_comparison():
    hits = _literal_mode_comparisons('if cfg.algo.routing_replay == "r3":\n    x = "r3"\n', ["r3"])
    assert hits == ['if cfg.algo.routing_replay == "r3":']


def test_no_mode_is_compared_as_a_string_literal_outside_its_enum_module():
    owner = _mode_values()
    offenders = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "launch").rglob("*.py")]:
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts)
        values = [v for v, m in owner.items() if m != module]
        offenders += [f"{rel}: {h}" for h in _literal_mode_comparisons(path.read_text(), values)]
    assert offenders == []


# Modules that may pass 400 lines because they are one concept (up to LONG_CAP), each with why.
# Splitting such a module to fit the cap scatters one idea over files that import each other's
# internals; name it here instead.
LONG_MODULES = {
    "megatron_gspo/rollout/launcher.py": "one concept: a supervised group of server processes "
    "(start, health, restart with backoff, stop), whose state the parts share",
    "megatron_gspo/server/model.py": "one concept: the rollout model's forward over a step's "
    "chunks (how they are batched, attention over the cache, experts), one set of numerics",
}
LONG_CAP = 800


def test_no_module_over_400_lines_and_no_function_over_60():
    long_files, long_functions = [], []
    for name in LONG_MODULES:
        assert (ROOT / name).is_file(), f"LONG_MODULES names {name}, which does not exist"
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        cap = LONG_CAP if str(rel) in LONG_MODULES else 400
        if len(text.splitlines()) > cap:
            long_files.append(f"{rel}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {length}")
    assert long_files == [] and long_functions == []


def test_no_private_name_is_imported_from_another_module():
    """A `_private` name is its module's own: another module (or a test) that needs it gets a
    public name, never an import of the private one (nor a public one renamed private)."""
    offenders = []
    for path in [
        *PKG.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_gspo"):
                for alias in node.names:
                    names = [alias.name, alias.asname or ""]
                    if any(n.startswith("_") and not n.startswith("__") for n in names):
                        offenders.append(f"{path.relative_to(ROOT)}: {alias.name}")
    assert offenders == []
