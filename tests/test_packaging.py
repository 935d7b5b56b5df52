"""pyproject.toml: setuptools reads it without deprecation warnings (license as an SPDX string), optional stacks
stay extras, and nothing in the repository needs a directory outside it (a user's clone has no ../shared)."""

from __future__ import annotations

import re
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_setuptools_reads_pyproject_without_warnings(monkeypatch):
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    msgs = [str(w.message) for w in caught]
    assert not [m for m in msgs if "deprecat" in m.lower()], msgs
    assert dist.metadata.license_expression == "Apache-2.0"


def test_optional_stacks_are_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "wandb" not in core and "prometheus" not in core
    assert any(d.startswith("wandb") for d in project["optional-dependencies"]["wandb"])


def test_nothing_needs_a_directory_outside_the_repository():
    """Tests, sources and the Makefile neither read nor point to ../shared or /work/shared (bench/results and
    docs/benchmarks-history.md are records of past measurements and may cite where a number came from)."""
    pattern = re.compile(r"(\.\./shared|/work/shared)")
    hits = []
    for sub in ("src", "tests", "Makefile", "pyproject.toml", "README.md", "docs"):
        p = ROOT / sub
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in (".py", ".toml", ".yaml", ".md", "")
                                         and f.is_file() and "__pycache__" not in f.parts]
        for f in files:
            if f == Path(__file__).resolve() or f.name == "benchmarks-history.md":   # built from bench/results
                continue
            try:
                text = f.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            hits += [f"{f.relative_to(ROOT)}:{i + 1}" for i, line in enumerate(text.splitlines())
                     if pattern.search(line)]
    assert not hits, hits
