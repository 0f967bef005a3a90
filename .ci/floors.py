"""Print ``name==floor`` pins for the declared minimum versions in pyproject.toml.

``make test-min`` installs these into a separate venv and runs the S3 and integration tests,
so every ``>=`` floor in ``[project] dependencies`` and in the ``integrations`` extra is one
that was tested. ``--override torch==2.13.0`` replaces a pin: the oldest torch wheels on PyPI
are CUDA builds (gigabytes of nvidia-* wheels), so torch is tested at the CPU wheel that
``make`` installs everywhere else.

    python .ci/floors.py [--extra integrations] [--override NAME==VERSION ...]
    python .ci/floors.py ... | python .ci/floors.py --verify   # installed == pinned?
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][A-Za-z0-9.]*)\s*(?:,.*)?$")


def floors(extras: list[str]) -> dict[str, str]:
    """``{name[extras]: floor}`` for each requirement with a ``>=`` floor."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for req in reqs:
        match = REQ.match(req)
        if match is None:
            if "==" in req or req.startswith("tierckpt"):
                continue
            sys.exit(f"{req!r} in pyproject.toml declares no '>=' floor; give it one")
        name, extra, version = match.groups()
        pins[name + (extra or "")] = version
    return pins


def verify(lines: list[str]) -> None:
    """Exit 1 unless each ``name==version`` pin is the installed version (pip may resolve
    another when a floor is not installable, and the test would then prove nothing)."""
    from importlib.metadata import PackageNotFoundError, version
    from packaging.version import Version

    wrong = []
    for line in filter(None, (x.strip() for x in lines)):
        name, _, pinned = line.partition("==")
        name = name.split("[")[0]
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        if have == "not installed" or Version(have.split("+")[0]) != Version(pinned):
            wrong.append(f"{name}: pinned {pinned}, installed {have}")
    if wrong:
        sys.exit("declared minimums not installed:\n  " + "\n  ".join(wrong))
    print(f"declared minimums installed: {len(lines)} packages")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[], help="extras to include too")
    parser.add_argument("--override", action="append", default=[], help="NAME==VERSION")
    parser.add_argument("--verify", action="store_true", help="check stdin's pins are installed")
    args = parser.parse_args()
    if args.verify:
        verify(sys.stdin.read().splitlines())
        return
    pins = floors(args.extra)
    for item in args.override:
        name, _, version = item.partition("==")
        if name not in pins:
            sys.exit(f"--override {item}: {name} is not a declared dependency")
        pins[name] = version
    for name, version in pins.items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
