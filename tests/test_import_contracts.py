"""The project's "no import circles inside a package folder" contract says no to a circle.

The contract is read from pyproject.toml as written and applied, by import-linter itself,
to a small package in a temporary folder: files of one folder importing each other (also
under TYPE_CHECKING, and one folder deeper) break it; the same files with one-way imports
keep it.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _acyclic_contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    assert contract["ancestors"] == [config["root_package"]]  # every folder of the package
    return contract


def _lint(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    contract = _acyclic_contract()
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "setup.cfg").write_text(
        "[importlinter]\nroot_package = pkg\n\n"
        f"[importlinter:contract:acyclic]\nname = {contract['name']}\ntype = {contract['type']}\nancestors = pkg\n"
    )
    return subprocess.run(
        [sys.executable, "-c", LINT, "--config", "setup.cfg", "--no-cache"],
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


ONE_WAY = {"__init__.py": "", "sub/__init__.py": "", "sub/batch.py": "from pkg.sub import rows\n", "sub/rows.py": ""}


def test_one_way_imports_keep_the_contract(tmp_path):
    result = _lint(tmp_path, ONE_WAY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


BACK_IMPORTS = ["from pkg.sub import batch\n", "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.sub.batch import x\n"]


@pytest.mark.parametrize("back", BACK_IMPORTS, ids=["import", "type-checking"])
def test_a_circle_in_a_folder_breaks_the_contract(tmp_path, back):
    result = _lint(tmp_path, {**ONE_WAY, "sub/rows.py": back})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 1 broken" in result.stdout
    assert "No cycles are allowed in pkg.sub." in result.stdout
