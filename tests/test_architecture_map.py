"""docs/architecture.md's map names every module of the package, the Serve app and the kernels:
a new module without a line there fails here (the map is where a newcomer looks first)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _map_text() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"^```\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert blocks, "docs/architecture.md has no map block"
    return "\n".join(blocks)


def test_the_map_names_every_module():
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _map_text()))
    modules = sorted(p.relative_to(REPO) for top in ("nvray", "deployments", "kernels")
                     for p in (REPO / top).rglob("*.py")
                     if p.stem != "__init__" and "__pycache__" not in p.parts)
    assert len(modules) > 100
    missing = [str(m) for m in modules if m.stem not in words]
    assert not missing, f"docs/architecture.md's map does not name {missing}"
