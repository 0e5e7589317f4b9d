"""The packages of the workspace and the arrows between them, drawn from their pyproject files.

    uv run python scripts/package_graph.py            # draws docs/package-graph.png
    uv run python scripts/package_graph.py --check    # exit 1 if the picture is out of date

A box per package (distribution and import name), an arrow from a package to each sibling it
depends on (its required dependencies; an arrow implied by a longer path is left out), rows by distance from the top so that every arrow points down; boxes
of packages that install without torch are drawn light. The graph drawn is stored in the
PNG's `Description` text, so `--check` (and tests/test_doc_figures.py) can compare the picture
with the pyproject files without comparing pixels.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICTURE = ROOT / "docs" / "package-graph.png"
OUR_PREFIX = "moestack-"
_NAME = re.compile(r"^[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Package:
    name: str
    """The distribution's name (moestack-...)."""
    module: str
    """Its import name."""
    siblings: tuple[str, ...]
    """The workspace distributions it requires, sorted."""
    torch: bool
    """Whether installing it installs torch."""


def _requirement_name(requirement: str) -> str:
    return _NAME.match(requirement.strip()).group(0).lower()


def read_packages(root: Path = ROOT) -> list[Package]:
    """Every packages/*/pyproject.toml, in name order."""
    packages = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        required = [_requirement_name(r) for r in project.get("dependencies", [])]
        module = next(p.name for p in (pyproject.parent / "src").iterdir() if p.is_dir())
        packages.append(
            Package(
                name=project["name"],
                module=module,
                siblings=tuple(sorted(r for r in required if r.startswith(OUR_PREFIX))),
                torch="torch" in required,
            )
        )
    return sorted(packages, key=lambda p: p.name)


def installs_torch(packages: list[Package]) -> dict[str, bool]:
    """Whether installing each package brings torch, itself or through a sibling."""
    by_name = {p.name: p for p in packages}

    def brings(name: str) -> bool:
        package = by_name[name]
        return package.torch or any(brings(s) for s in package.siblings)

    return {p.name: brings(p.name) for p in packages}


def depths(packages: list[Package]) -> dict[str, int]:
    """The row of each package, 0 the bottom: a package no sibling depends on is in the top
    row, and every other one row below the lowest package that depends on it."""
    found: dict[str, int] = {}

    def from_top(name: str) -> int:
        if name not in found:
            users = [p.name for p in packages if name in p.siblings]
            found[name] = 1 + max((from_top(u) for u in users), default=-1)
        return found[name]

    top = max(from_top(p.name) for p in packages)
    return {name: top - rank for name, rank in found.items()}


def reduced(packages: list[Package]) -> list[Package]:
    """`packages` with only the arrows no longer path implies (the transitive reduction): the
    arrows drawn."""
    by_name = {p.name: p for p in packages}

    def reachable(name: str) -> set[str]:
        found = set(by_name[name].siblings)
        for sibling in by_name[name].siblings:
            found |= reachable(sibling)
        return found

    kept = []
    for package in packages:
        implied = set().union(*(reachable(s) for s in package.siblings))
        siblings = tuple(s for s in package.siblings if s not in implied)
        kept.append(Package(package.name, package.module, siblings, package.torch))
    return kept


def described(packages: list[Package]) -> str:
    """The graph as the PNG stores it: {package: [siblings]} in JSON."""
    return json.dumps({p.name: list(p.siblings) for p in packages}, sort_keys=True)


def draw(packages: list[Package], out: Path) -> None:
    """The picture of `packages` into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch = installs_torch(packages)
    described_graph = described(packages)
    packages = reduced(packages)
    level = depths(packages)
    where = _positions(packages, level)
    width = max(x for x, _ in where.values()) + 0.5
    left = min(x for x, _ in where.values()) - 0.5
    fig, ax = plt.subplots(figsize=(2.3 * (width - left), 1.5 * (max(level.values()) + 1)))
    boxes = {}
    for package in packages:
        x, y = where[package.name]
        colour = "#cfe0f5" if torch[package.name] else "#ffffff"
        boxes[package.name] = ax.text(
            x, y, f"{package.name}\n{package.module}", ha="center", va="center", fontsize=9,
            zorder=2, bbox={"boxstyle": "round", "fc": colour, "ec": "#333"},
        )  # fmt: skip
    for package in packages:
        for sibling in package.siblings:
            skips = level[package.name] - level[sibling] > 1
            ax.annotate(
                "", xy=where[sibling], xytext=where[package.name], zorder=1,
                arrowprops={
                    "arrowstyle": "-|>", "color": "#555", "shrinkA": 2, "shrinkB": 2,
                    "patchA": boxes[package.name].get_bbox_patch(),
                    "patchB": boxes[sibling].get_bbox_patch(),
                    "connectionstyle": f"arc3,rad={0.2 if skips else 0}",
                },
            )  # fmt: skip
    ax.set_xlim(left, width)
    ax.set_ylim(-0.6, max(level.values()) + 0.6)
    ax.axis("off")
    ax.set_title(
        "arrow: depends on (an arrow a longer path implies is not drawn); "
        "blue: installs torch, white: installs without it",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Description": described_graph})
    plt.close(fig)


def _positions(packages: list[Package], level: dict[str, int]) -> dict[str, tuple[float, int]]:
    """(x, row) of each box: the top row side by side; each box below under the mean of the
    boxes with an arrow to it, its row spread to one box width apart around the same mean."""
    rows: dict[int, list[Package]] = {}
    for package in packages:
        rows.setdefault(level[package.name], []).append(package)
    where: dict[str, tuple[float, int]] = {}
    for depth in sorted(rows, reverse=True):

        def wanted(package: Package) -> float:
            xs = [where[p.name][0] for p in packages if package.name in p.siblings]
            return sum(xs) / len(xs) if xs else 0.0

        row = sorted(rows[depth], key=wanted)  # stable: name order among equals
        xs: list[float] = []
        for package in row:
            xs.append(max(wanted(package), xs[-1] + 1.0) if xs else wanted(package))
        shift = sum(map(wanted, row)) / len(row) - sum(xs) / len(xs)
        for package, x in zip(row, xs, strict=True):
            where[package.name] = (x + shift, depth)
    return where


def drawn_graph(picture: Path) -> str | None:
    """The graph stored in `picture`'s Description text (None without one)."""
    from PIL import Image

    with Image.open(picture) as image:
        return image.text.get("Description")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the picture is stale")
    parser.add_argument("--out", type=Path, default=PICTURE)
    args = parser.parse_args(argv)
    packages = read_packages()
    if args.check:
        if not args.out.exists() or drawn_graph(args.out) != described(packages):
            print(f"{args.out} is out of date: run scripts/package_graph.py", file=sys.stderr)
            return 1
        return 0
    draw(packages, args.out)
    print(f"wrote {args.out}: {len(packages)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
