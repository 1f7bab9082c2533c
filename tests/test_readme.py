"""The measured figures of the README and of the benchmarks' record are generated from committed
result files, never typed by hand, and every result file is cited by one of them."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tables_module():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "experiments" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _linked(doc: Path) -> set[Path]:
    """The files `doc` links to, resolved as a markdown renderer resolves relative links."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
    return {Path(os.path.normpath(doc.parent / t)) for t in targets if not re.match(r"[a-z]+:", t)}


def test_generated_tables_match_the_result_files():
    tables = _tables_module()
    for doc in tables.DOCUMENTS:
        current = doc.read_text()
        assert tables.render(current, doc) == current, (
            f"{doc.relative_to(REPO)}'s generated tables differ from experiments/results/: run "
            "python experiments/readme_tables.py --write"
        )


def test_every_result_file_is_cited():
    tables = _tables_module()
    readme = tables.README.read_text()
    record = _linked(tables.BENCHMARKS_RECORD)
    results = REPO / "experiments" / "results"
    for path in results.glob("**/summary.json"):
        assert str(path.relative_to(REPO)) in readme, f"{path} is not cited in README.md"
    for path in (results / "benchmarks").glob("*.json"):
        assert path in record or str(path.relative_to(REPO)) in readme, (
            f"{path} is cited neither by README.md nor by {tables.BENCHMARKS_RECORD.relative_to(REPO)}")


def test_the_documents_links_resolve():
    tables = _tables_module()
    for doc in tables.DOCUMENTS:
        missing = sorted(str(p.relative_to(REPO)) for p in _linked(doc) if not p.exists())
        assert not missing, f"{doc.relative_to(REPO)} links to files that do not exist: {missing}"
