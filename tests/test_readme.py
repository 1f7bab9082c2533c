"""The README's measured figures are generated from committed result files, never typed by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tables_module():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "experiments" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_match_the_result_files():
    tables = _tables_module()
    current = (REPO / "README.md").read_text()
    assert tables.render(current) == current, (
        "README.md's generated tables differ from experiments/results/: run "
        "python experiments/readme_tables.py --write"
    )


def test_every_result_file_reaches_the_readme():
    tables = _tables_module()
    readme = (REPO / "README.md").read_text()
    results = REPO / "experiments" / "results"
    for path in [*results.glob("**/summary.json"), *(results / "benchmarks").glob("*.json")]:
        assert str(path.relative_to(REPO)) in readme, f"{path} is not cited in README.md"
