"""ruff and mypy, configured in pyproject.toml ([tool.ruff], [tool.mypy]), are clean.

ruff checks the whole tree (the package, kernels, tests, benchmarks, the course and lab
sources); mypy checks ``minivllm/`` and ``minivllm_kernels/``. Each test fails with the tool's own
report and skips only when the tool is not installed (both are in the ``dev`` extra).
mypy's first run parses torch's annotations (a minute or two on 2 cores); later runs
reuse ``.mypy_cache`` (seconds).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]' installs it)")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_ruff_is_clean():
    r = _run_tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, f"ruff check found problems:\n{r.stdout}{r.stderr}"


def test_mypy_is_clean():
    r = _run_tool("mypy")  # files and settings: [tool.mypy] in pyproject.toml
    assert r.returncode == 0, f"mypy found problems:\n{r.stdout}{r.stderr}"
