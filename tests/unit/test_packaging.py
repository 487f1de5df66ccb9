"""Every file of the package ships: none is ignored by git (hatchling leaves ignored paths out
of the wheel: a `build/` pattern once dropped the whole sm121_build/jobs/ stage), and every
stage folder is a regular package."""

from __future__ import annotations

import subprocess

from devkit.helpers import ROOT


def test_no_package_file_is_ignored() -> None:
    files = [str(p.relative_to(ROOT)) for p in (ROOT / "sm121_build").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=ROOT,
                             capture_output=True, text=True, check=False).stdout.split()
    assert ignored == []
    tracked = set(subprocess.run(["git", "ls-files", "sm121_build"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.split())
    assert {f for f in files if f.endswith((".py", ".yaml", ".json"))} <= tracked


def test_every_stage_is_a_package() -> None:
    for folder in (p for p in (ROOT / "sm121_build").iterdir()
                   if p.is_dir() and p.name not in {"data", "__pycache__"}):
        assert (folder / "__init__.py").is_file(), folder.name
