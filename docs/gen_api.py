"""Generate docs/api.md from the package's docstrings: ``python docs/gen_api.py``.

Every module listed in MODULES contributes the names in its ``__all__``: functions with their
signatures, classes with their constructor and public methods and properties, each followed by
its docstring. Run it after changing a public docstring; ``--check`` exits 1 when api.md is
stale (for CI).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

#: (module, heading); modules whose optional dependency is missing are listed as such
MODULES = [
    ("tierckpt", "The public API (`import tierckpt`)"),
    ("tierckpt.stats", "Observability"),
    ("tierckpt.offline", "Offline tools (what the CLI uses)"),
    ("tierckpt.export", "Export to safetensors"),
    ("tierckpt.backends.base", "Backend contract"),
    ("tierckpt.codecs.base", "Codec contract and registry"),
    ("tierckpt.format", "On-disk format"),
    ("tierckpt.catalog", "Catalog (what is committed on a tier)"),
    ("tierckpt.retention", "Retention"),
    ("tierckpt.commit", "Commit strategy"),
    ("tierckpt.distributed", "Multi-rank"),
    ("tierckpt.dcp", "torch.distributed.checkpoint"),
    ("tierckpt.integrations.lightning", "PyTorch Lightning"),
    ("tierckpt.integrations.hf", "Hugging Face transformers"),
    ("tierckpt.integrations", "Integration helpers"),
    ("tierckpt.integrations.sinks", "Metrics sinks"),
]


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    # reST roles read fine as code in Markdown
    doc = re.sub(r":(?:class|func|meth|mod|attr|data|exc):`~?([^`]+)`", r"`\1`", doc)
    return _markdown(doc.replace("``", "`"))


_SECTIONS = ("Args:", "Arguments:", "Returns:", "Raises:", "Attributes:", "Yields:")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _markdown(doc: str) -> str:
    """Google/reST docstring layout to Markdown: literal blocks fenced, Args as lists,
    simple tables fenced, indented definition bodies dedented."""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("====="):  # a reST simple table: keep it monospaced
            end = i + 1
            seen = 1
            while end < len(lines) and seen < 3:
                if lines[end].strip().startswith("====="):
                    seen += 1
                end += 1
            out += ["```", *lines[i:end], "```"]
            i = end
            continue
        if stripped.endswith("::") and not stripped.startswith("-"):
            text = line.rstrip()[:-1].rstrip()
            if text.strip():
                out.append(text if text.endswith(":") else text + ":")
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block: list[str] = []
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line)):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            base = min((_indent(b) for b in block if b.strip()), default=0)
            body = [b[base:] for b in block]
            lang = "python" if re.search(r"\bimport\b|\w\(", "\n".join(body)) else ""
            out += ["", f"```{lang}", *body, "```", ""]
            i = j
            continue
        if stripped in _SECTIONS and i + 1 < len(lines) and _indent(lines[i + 1]) > _indent(line):
            out += ["", f"**{stripped[:-1]}**", ""]
            j = i + 1
            base = _indent(lines[j])
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) >= base):
                cur = lines[j]
                if not cur.strip():
                    j += 1
                    continue
                if _indent(cur) == base:
                    m = re.match(r"\s*([^:]+?):\s*(.*)", cur)
                    if m:
                        out.append(f"- `{m.group(1)}`: {m.group(2)}")
                    else:
                        out.append(f"- {cur.strip()}")
                else:
                    out[-1] += " " + cur.strip()
                j += 1
            out.append("")
            i = j
            continue
        if (
            line
            and _indent(line) > 0
            and out
            and out[-1].strip()
            and _indent(out[-1]) == 0
            and not out[-1].startswith(("```", "-", "|"))
            and not re.match(r"\d+\. ", out[-1])
        ):  # a numbered item's continuation
            # a definition body ("Term\n    text"): the term bold, the body its paragraph
            out[-1] = f"**{out[-1].strip()}**"
            out.append("")
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > 0):
                out.append(lines[i].strip())
                i += 1
            out.append("")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _sig(obj: Any) -> str:
    try:
        s = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    s = re.sub(r"<(?:function|built-in function) ([\w.]+) at 0x[0-9a-f]+>", r"\1", s)
    return re.sub(r" at 0x[0-9a-f]+", "", s).replace("'", "")


def _private_bases(cls: type) -> list[type]:
    """Bases of ``cls`` defined in the library's private modules (their public methods, such
    as ``close()``, belong to ``cls``'s documentation: nowhere else documents them)."""
    return [
        b for b in cls.__mro__[1:] if b.__module__.startswith("tierckpt.") and "._" in b.__module__
    ]


def _own_members(cls: type) -> list[tuple[str, Any]]:
    out = []
    seen = set(cls.__dict__)
    inherited = [
        (n, v) for b in _private_bases(cls) for n, v in b.__dict__.items() if n not in seen
    ]
    for name, value in [*cls.__dict__.items(), *inherited]:
        if name in {n for n, _ in out}:
            continue
        if name.startswith("_") and name not in ("__enter__",):
            continue
        if name == "__enter__":
            continue
        if (
            isinstance(value, property)
            or inspect.isfunction(value)
            or isinstance(value, (classmethod, staticmethod))
        ):
            out.append((name, value))
    return out


def document_class(name: str, cls: type, lines: list[str]) -> None:
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    lines.append(f"### class `{name}`" + (f" ({', '.join(bases)})" if bases else ""))
    lines.append("")
    init = cls.__dict__.get("__init__")
    if init is not None and inspect.isfunction(init):
        sig = _sig(init).replace("(self, ", "(").replace("(self)", "()")
        lines.append(f"```python\n{name}{sig}\n```")
        lines.append("")
    elif "__dataclass_fields__" in cls.__dict__:
        lines.append(f"```python\n{name}{_sig(cls)}\n```")
        lines.append("")
    doc = _doc(cls)
    if doc:
        lines.append(doc)
        lines.append("")
    for mname, member in _own_members(cls):
        if isinstance(member, property):
            mdoc = _doc(member)
            lines.append(
                f"- **`{mname}`** (property)" + (f": {mdoc.splitlines()[0]}" if mdoc else "")
            )
            continue
        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        mdoc = _doc(fn)
        sig = _sig(fn).replace("(self, ", "(").replace("(self)", "()").replace("(cls, ", "(")
        lines.append(f"- **`{mname}{sig}`**")
        if mdoc:
            lines.append("")
            lines.extend("  " + ln if ln else "" for ln in mdoc.splitlines())
        lines.append("")
    lines.append("")


def document_module(modname: str, heading: str, lines: list[str]) -> None:
    lines.append(f"## {heading}")
    lines.append("")
    lines.append(f"`{modname}`")
    lines.append("")
    try:
        mod = importlib.import_module(modname)
    except ImportError as exc:
        lines.append(f"*Not importable here ({exc}).*")
        lines.append("")
        return
    if modname != "tierckpt":
        doc = _doc(mod)
        if doc:
            lines.append(doc)
            lines.append("")
    names = [n for n in getattr(mod, "__all__", []) if not n.startswith("__")]
    for name in names:
        obj = getattr(mod, name, None)
        if obj is None:
            continue
        home = getattr(obj, "__module__", modname)
        # a package's private modules (tierckpt.dcp._writer) are documented with the package
        if home.startswith(f"{modname}._"):
            home = modname
        if (
            modname != "tierckpt"
            and home != modname
            and not modname.startswith("tierckpt.integrations")
        ):
            continue  # documented where it lives
        if inspect.isclass(obj):
            document_class(name, obj, lines)
        elif inspect.isfunction(obj):
            lines.append(f"### `{name}{_sig(obj)}`")
            lines.append("")
            doc = _doc(obj)
            if doc:
                lines.append(doc)
                lines.append("")
        else:
            lines.append(f"### `{name}` = `{obj!r}`"[:200])
            lines.append("")


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `docs/gen_api.py`; do not edit by hand. The prose "
        "guides are [quickstart](quickstart.md), [concepts](concepts.md), [tiers](tiers.md), "
        "[object stores](object-stores.md) and the [format](format.md).",
        "",
    ]
    toc = [
        f"- [{h}](#{re.sub(r'[^a-z0-9 -]', '', h.lower()).replace(' ', '-')})" for _, h in MODULES
    ]
    lines.extend(toc)
    lines.append("")
    for modname, heading in MODULES:
        document_module(modname, heading, lines)
    text = "\n".join(lines).rstrip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = p.parse_args()
    path = os.path.join(HERE, "api.md")
    text = render()
    if args.check:
        with open(path, encoding="utf-8") as f:
            stale = f.read() != text
        print("docs/api.md is stale: run python docs/gen_api.py" if stale else "up to date")
        return 1 if stale else 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(path)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
