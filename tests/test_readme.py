"""The README's tour runs as written, its commands are the ones CI runs, and the module
layout table of docs/design.md names every module of the tree."""

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_api_tour_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## A short tour\n\n```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    y, y2, r = ns["y"], ns["y2"], ns["r"]
    assert y.shape == (4, 7, 64)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y2), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), np.asarray(ns["routing"].expert_ids))
    np.testing.assert_allclose(np.asarray(ns["y3"]), np.asarray(y), rtol=1e-5, atol=1e-5)  # invariant: same layer


def test_ci_runs_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    first = re.findall(r"```bash\n(.*?)```", readme, re.S)[0]  # the first screen: install + main job, tests
    install, tests = (line.split("#")[0].strip() for line in first.strip().splitlines())
    assert "pip install -e '.[test]'" in install and "pip install -e '.[test]'" in ci
    assert "jaxmoe eval" in install and "jaxmoe eval" in ci
    assert tests == "python -m pytest -q" and tests.replace("python ", "python3 ") in ci


def test_design_layout_matches_the_tree():
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"## Module layout and import direction\n(.*?)\n## ", text + "\n## ", re.S).group(1)
    words = set(re.findall(r"[\w.]+/?", block))
    pkg = ROOT / "jaxmoe"
    entries = {p.name + ("/" if p.is_dir() else "") for p in pkg.iterdir() if p.name != "__pycache__"}
    entries -= {"__init__.py", "py.typed"}
    missing = sorted(e for e in entries if e not in words)
    assert not missing, f"jaxmoe entries not in docs/design.md's module layout: {missing}"
    impls = {p.name + ("/" if p.is_dir() else "") for p in (pkg / "impls").iterdir() if p.name != "__pycache__"}
    missing = sorted(e for e in impls - {"__init__.py"} if e not in words)
    assert not missing, f"jaxmoe/impls entries not in docs/design.md's module layout: {missing}"
    for w in words:
        if w.endswith(".py"):
            hits = [*pkg.rglob(w), *(ROOT / ".ci").glob(w), *(ROOT / "tests").glob(w)]
            assert hits, f"docs/design.md's module layout names {w}, which is not in the tree"
    for top in ("pallas_kernels/", "configs/"):
        assert top in words and (ROOT / top).is_dir(), top
