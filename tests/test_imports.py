"""The modules of the jax_arx package import each other without a circle.

Every import between the package's modules counts, those inside functions
too (a deferred import hides a circle from Python, not from a reader). The
package's ``__init__`` is left out: it imports everything to export it.
Each module's place in the order is what docs/architecture.md describes:
a module imports only modules below it.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_arx"


def _edges() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m in modules:
        for node in ast.walk(ast.parse((PACKAGE / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jax_arx":
                edges[m] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_arx."):
                edges[m].add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                edges[m] |= {a.name.split(".")[1] for a in node.names if a.name.startswith("jax_arx.")}
        edges[m] &= modules
        edges[m].discard(m)
    return edges


def _a_circle(edges):
    """One circle of the graph, as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle_in_the_package():
    edges = _edges()
    assert "_comm" in edges and edges["_comm"], "found no imports: has the package moved?"
    circle = _a_circle(edges)
    assert circle is None, "jax_arx's modules import each other in a circle: " + " -> ".join(circle)


def test_the_check_finds_a_circle():
    assert _a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_circle({"a": {"b"}, "b": set()}) is None
