"""The repository holds the product: what is committed beside the code, stated as specifications.

* benchmarks/results/ keeps only the raw outputs the docs cite, one file each, and every one they
  cite is there (docs/architecture.md, "Where a benchmark lives"); git history keeps the rest;
* the README stays under 250 lines: the details live in docs/;
* pyflakes' checks find nothing: no unused import (F401), no redefinition of an unused name (F811),
  no unused local variable (F841), in mdcli/, tests/ and benchmarks/ (ruff, in the test extra).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README_MAX_LINES = 250
PYFLAKES_CHECKS = "F401,F811,F841"


def committed(folder: Path) -> list[str]:
    """The files git tracks under `folder`, relative to it (a run's fresh outputs are not among them)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: what is committed cannot be asked")
    listed = subprocess.run(["git", "ls-files", "-z", "--", str(folder.relative_to(ROOT))], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return sorted(Path(name).relative_to(folder.relative_to(ROOT)).as_posix() for name in listed.split("\0") if name)


def documentation() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_every_committed_result_is_named_by_the_docs():
    docs = documentation()
    uncited = [name for name in committed(RESULTS) if name not in docs]
    assert not uncited, f"results no doc cites (git rm them; history keeps them): {uncited}"


def test_every_result_the_docs_link_to_is_committed():
    linked = set(re.findall(r"\]\(\.\./benchmarks/results/([^)#]+)\)", documentation()))
    assert linked, "the docs link to no result: the pattern above no longer matches their links"
    missing = sorted(linked - set(committed(RESULTS)))
    assert not missing, f"the docs link to results that are not committed: {missing}"


def test_the_readme_is_under_250_lines():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move details to docs/"


def pyflakes_findings() -> dict[str, list[str]]:
    """file -> its findings ("F401 line 3: `x` imported but unused"), from ruff over the three folders."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    done = subprocess.run([ruff, "check", "--isolated", "--select", PYFLAKES_CHECKS, "--output-format", "json",
                           "mdcli", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode in (0, 1), done.stderr
    found: dict[str, list[str]] = {}
    for finding in json.loads(done.stdout):
        name = Path(finding["filename"]).resolve().relative_to(ROOT).as_posix()
        found.setdefault(name, []).append(f"{finding['code']} line {finding['location']['row']}: {finding['message']}")
    return found


def test_pyflakes_finds_no_unused_import_redefinition_or_unused_variable():
    found = pyflakes_findings()
    assert not found, f"ruff check --select {PYFLAKES_CHECKS}: {found}"
