"""A library user who only reads tables needs none of the server or benchmark dependencies (extras serve, bench)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("fastapi", "uvicorn", "httpx", "matplotlib", "prometheus_client")


@pytest.mark.parametrize("package", ["tiergram.store", "tiergram.format", "tiergram.hashing", "tiergram.tiers",
                                     "tiergram.engram", "tiergram.model"])
def test_library_imports_no_optional_dependency(package):
    """Importing the table-reading layers (in a fresh interpreter) loads none of the extras' packages."""
    code = (f"import sys, {package}\n"
            f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert got.stdout.strip() == "", f"importing {package} imported {got.stdout.strip()}"


def test_extras_are_declared_where_they_are_used():
    """fastapi/uvicorn/httpx/matplotlib/prometheus-client are extras, not core; torch is at least 2.5 (enable_gqa)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not [m for m in OPTIONAL if m.replace("_", "-") in core]
    extras = project["optional-dependencies"]
    assert {"fastapi", "uvicorn", "prometheus-client"} <= {r.split(">")[0] for r in extras["serve"]}
    assert {"matplotlib", "httpx", "fastapi", "uvicorn"} <= {r.split(">")[0] for r in extras["bench"]}
    dev = {r.split(">")[0].split(";")[0].strip("'\" ") for r in extras["dev"]}
    assert {m.replace("_", "-") for m in OPTIONAL} <= dev
    assert "torch>=2.5" in project["dependencies"]
