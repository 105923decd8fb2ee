"""The package layering of pyproject.toml ([tool.importlinter]; docs/architecture.md) holds,
and a wrong arrow really fails it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_trainer_importing_serving_breaks_the_layering(tmp_path):
    driver = _copy_tree(tmp_path) / "streamrec" / "trainer" / "driver.py"
    driver.write_text(driver.read_text() + "\nfrom streamrec.serving.http.app import create_app  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "streamrec.trainer.driver -> streamrec.serving.http.app" in result.stdout and "1 broken" in result.stdout


def test_serving_runtime_importing_the_node_breaks_the_rooms(tmp_path):
    """Inside serving, calls go down only: the model runtime never reaches up to the node above it."""
    runtime = _copy_tree(tmp_path) / "streamrec" / "serving" / "runtime" / "model_runtime.py"
    runtime.write_text(runtime.read_text() + "\nfrom streamrec.serving.node import ServingNode  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "streamrec.serving.runtime.model_runtime -> streamrec.serving.node" in result.stdout and "1 broken" in result.stdout


def test_the_contracts_importing_config_breaks_the_layering(tmp_path):
    """The contracts are the bottom layer: even the plumbing above them is out of reach."""
    spec = _copy_tree(tmp_path) / "streamrec" / "contracts" / "feature_spec.py"
    spec.write_text(spec.read_text() + "\nfrom streamrec.plumbing.config import Config  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "streamrec.contracts.feature_spec -> streamrec.plumbing.config" in result.stdout


def _copy_tree(root: Path) -> Path:
    shutil.copytree(REPO / "streamrec", root / "streamrec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_no_module_imports_itself_through_others():
    """No import cycles between our modules (each would make the import order matter)."""
    grimp = pytest.importorskip("grimp")  # import-linter's graph; absent where only `pytest -m gpu` runs
    graph = grimp.build_graph("streamrec", exclude_type_checking_imports=True)  # those never run
    cycles = sorted((a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                    if graph.chain_exists(importer=b, imported=a))
    assert cycles == []
