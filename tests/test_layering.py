"""The package's import graph has no cycle, counting imports inside functions too: each
module depends only on modules below it (docs/architecture.md draws the layers). The model pieces
and the configuration sit below the decoding package, and decoding below the data pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

import dflashkit

ROOT = Path(dflashkit.__file__).parent


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflashkit"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n not in (m, "dflashkit")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        state[u] = 2
        path.pop()
        return None

    return next((c for u in sorted(graph) if u not in state and (c := visit(u))), None)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    graph = import_graph()
    assert "dflashkit.decode.loop" in graph and "dflashkit.decode.engine" in graph["dflashkit.decode.loop"]
    assert find_cycle(graph) is None


def test_decoding_leaf_and_server_layers():
    graph = import_graph()
    assert not graph["dflashkit.decode.generation"], "decode/generation.py is the leaf: it imports nothing of dflashkit"
    decoding = {m for m in graph if m.startswith("dflashkit.decode")}
    assert all("dflashkit.serve" not in graph[m] for m in decoding), "decoding must not depend on the server"


def test_model_pieces_and_configuration_sit_below_decoding():
    graph = import_graph()
    for low in ("dflashkit.drafter", "dflashkit.config", "dflashkit.method", "dflashkit.kernels.heads",
                "dflashkit.kernels.packed"):
        above = sorted(m for m in graph[low] if m == "dflashkit.decode" or m.startswith("dflashkit.decode."))
        assert not above, f"{low} imports {above}: the decoding package sits above it"
    assert not graph["dflashkit.method"], "method.py is a leaf: it imports nothing of dflashkit"
    decoding = {m for m in graph if m.startswith("dflashkit.decode")}
    data = sorted((m, d) for m in decoding for d in graph[m] if d.startswith("dflashkit.data"))
    assert not data, f"decoding imports the data pipeline: {data}"


def test_layering_rules_see_an_import_inside_a_function(tmp_path, monkeypatch):
    """The graph counts an import inside a function as the module's own (the rule above would
    otherwise miss the lazy kind)."""
    pkg = tmp_path / "dflashkit"
    (pkg / "decode").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "decode" / "__init__.py").write_text("")
    (pkg / "decode" / "cache.py").write_text("")
    (pkg / "drafter.py").write_text("def f():\n    from dflashkit.decode.cache import KVCache\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert import_graph()["dflashkit.drafter"] == {"dflashkit.decode.cache"}
