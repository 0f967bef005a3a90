"""Draw the package's import graph from the code: ``python docs/gen_architecture.py``.

Parses every module under ``tierckpt/`` with :mod:`ast` (nothing is imported), groups modules
into the units ``docs/architecture.md`` describes (a subpackage is one unit, a top-level
module is one unit), and writes

* ``docs/img/architecture.png``: the units in layers (a unit sits above everything it
  imports), an arrow per import between units;
* the Mermaid block between the ``<!-- graph:begin -->`` / ``<!-- graph:end -->`` markers of
  ``docs/architecture.md`` (GitHub and mkdocs render it as the same picture).

Imports inside functions count (they are dependencies too) and are drawn dashed.
``--check`` exits 1 when the Mermaid block in architecture.md is stale.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PKG = os.path.join(ROOT, "tierckpt")
DOC = os.path.join(HERE, "architecture.md")
PNG = os.path.join(HERE, "img", "architecture.png")
BEGIN, END = "<!-- graph:begin -->", "<!-- graph:end -->"

#: units that exist for people, not for training runs: drawn apart, below the runtime
OUTSIDE_RUNTIME = {"bench", "demo", "testing", "cli"}
#: units everything may import (errors, shared types): listed, not drawn as arrows
FOUNDATION = {"errors", "_types"}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def unit_of(module: str) -> str | None:
    """``tierckpt.backends.s3`` -> ``backends``; ``tierckpt`` (the package root) -> ``api``."""
    parts = module.split(".")
    if parts[0] != "tierckpt":
        return None
    if len(parts) == 1:
        return "api"
    return parts[1]


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out[module_name(path)] = path
    return out


def imports_of(module: str, path: str) -> list[tuple[str, bool]]:
    """(imported tierckpt module, at module level?) for every import in ``path``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    is_pkg = path.endswith("__init__.py")
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # typing-only imports are not dependencies at run time
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names if a.name.startswith("tierckpt"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - child.level + 1]
                    target = ".".join([*anchor, *(child.module.split(".") if child.module else [])])
                else:
                    target = child.module or ""
                if target.startswith("tierckpt"):
                    found.append((target, top))
                    for a in child.names:  # `from tierckpt import bench` names a module
                        found.append((f"{target}.{a.name}", top))
            visit(child, nested)

    visit(tree, True)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def unit_graph() -> tuple[list[str], dict[tuple[str, str], bool]]:
    """Units and edges {(importer, imported): any import at module level}."""
    mods = modules()
    units = sorted({u for m in mods if (u := unit_of(m)) is not None})
    edges: dict[tuple[str, str], bool] = {}
    for m, path in mods.items():
        src = unit_of(m)
        for target, top in imports_of(m, path):
            # `from tierckpt.x import name`: count only names that are modules or units
            if target not in mods and target.rsplit(".", 1)[0] in mods:
                target = target.rsplit(".", 1)[0]
            dst = unit_of(target)
            if src is None or dst is None or dst == src or dst == "api":
                continue
            edges[(src, dst)] = edges.get((src, dst), False) or top
    return units, edges


def layers(units: list[str], edges: dict[tuple[str, str], bool]) -> dict[str, int]:
    """Longest-path layering (0 = imports nothing); a cycle is cut where it is met."""
    deps: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        deps[a].add(b)
    level: dict[str, int] = {}

    def depth(u: str, seen: tuple[str, ...]) -> int:
        if u in level:
            return level[u]
        if u in seen:  # a cycle: drawn, and the architecture test fails on it
            return 0
        d = 1 + max((depth(v, (*seen, u)) for v in deps[u]), default=-1)
        level[u] = d
        return d

    for u in units:
        depth(u, ())
    return level


def mermaid(units: list[str], edges: dict[tuple[str, str], bool]) -> str:
    lines = ["```mermaid", "graph TD"]
    for u in units:
        shape = f"{u}[/{u}/]" if u in OUTSIDE_RUNTIME else f"{u}[{u}]"
        lines.append(f"  {shape}")
    for (a, b), top in sorted(edges.items()):
        lines.append(f"  {a} {'-->' if top else '-.->'} {b}")
    lines.append("```")
    return "\n".join(lines)


def draw(units: list[str], edges: dict[tuple[str, str], bool], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    level = layers(units, edges)
    rows: dict[int, list[str]] = defaultdict(list)
    for u in units:
        rows[level[u]].append(u)
    height = max(rows) + 1
    pos = {}
    for lv, names in rows.items():
        names.sort(key=lambda n: (n in OUTSIDE_RUNTIME, n))
        for i, n in enumerate(names):
            pos[n] = ((i + 0.5) / len(names), lv / max(height - 1, 1))
    fig, ax = plt.subplots(figsize=(14, 1.4 * height + 1))
    for (a, b), top in edges.items():
        if b in FOUNDATION:
            continue  # nearly everything imports them: arrows there would hide the rest
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops={
                "arrowstyle": "-|>",
                "color": "0.55" if top else "tab:orange",
                "lw": 0.7,
                "linestyle": "-" if top else "--",
                "shrinkA": 14,
                "shrinkB": 14,
            },
        )
    for n, (x, y) in pos.items():
        ax.text(
            x,
            y,
            n,
            ha="center",
            va="center",
            fontsize=9,
            bbox={
                "boxstyle": "round,pad=0.35",
                "fc": "#f4e3c1" if n in OUTSIDE_RUNTIME else "#dbe8f6",
                "ec": "0.3",
            },
        )
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.08, 1.08)
    ax.axis("off")
    ax.set_title(
        "tierckpt: units and their imports (an arrow points at what is imported; "
        "dashed = inside a function; tan = outside the runtime;\n"
        "arrows into errors and _types, which any unit may import, are left out)",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if architecture.md is stale")
    args = ap.parse_args(argv)
    units, edges = unit_graph()
    block = f"{BEGIN}\n{mermaid(units, edges)}\n{END}"
    with open(DOC, encoding="utf-8") as fh:
        doc = fh.read()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{block}{tail}"
    if args.check:
        if new != doc:
            print("docs/architecture.md is stale: run python docs/gen_architecture.py")
            return 1
        return 0
    with open(DOC, "w", encoding="utf-8") as fh:
        fh.write(new)
    draw(units, edges, PNG)
    print(f"wrote {os.path.relpath(DOC, ROOT)} and {os.path.relpath(PNG, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
