"""The shape docs/design.md draws is the code's: its tree names every module, and its import floors hold (issue 26)."""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "design.md").read_text()


def floors() -> dict[str, int]:
    """docs/design.md's table: each box (a top-level module or a folder) and its floor."""
    table = DESIGN.split("Import floors, lowest first")[1].split("\n\n")[1]
    out: dict[str, int] = {"__init__": 0}
    for floor, names in re.findall(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for name in re.findall(r"`([\w]+)/?`", names.split(" (")[0]):  # not the remarks in parentheses
            out[name] = int(floor)
    return out


def modules() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "supervisor"], cwd=ROOT, capture_output=True, text=True).stdout
    return sorted({ROOT / f for f in listed.split() if f.endswith(".py")} | set((ROOT / "supervisor").rglob("*.py")))


def box(path: Path) -> str:
    rel = path.relative_to(ROOT / "supervisor").with_suffix("").parts
    return rel[0]


def test_the_design_tree_names_every_module_of_the_package() -> None:
    tree = DESIGN.split("## The tree: one folder per box")[1].split("```")[1]
    missing = [str(p.relative_to(ROOT)) for p in modules() if p.name != "__init__.py" and p.name not in tree]
    assert missing == []


def test_no_module_imports_a_floor_above_its_own_and_no_two_boxes_import_each_other() -> None:
    table = floors()
    above, edges = [], defaultdict(set)
    for path in modules():
        mine = box(path)
        assert mine in table, f"{mine}: give it a floor in docs/design.md"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "supervisor" or len(parts) < 2 or parts[1] == mine:
                    continue
                theirs = parts[1]
                edges[mine].add(theirs)
                if table.get(theirs, 99) > table[mine]:
                    above.append(f"{path.relative_to(ROOT)} imports {name} (floor {table.get(theirs)} > {table[mine]})")
    assert above == []
    mutual = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, set())})
    assert mutual == []
