"""What the layers promise at run time (ARCHITECTURE.md; the import contracts themselves run
in .ci/lint with lint-imports): `audit FILE` loads neither Docker nor the engine, git, the
renderer or any job, and each command's module is loaded only when that command runs."""

from __future__ import annotations

import sys

from devkit.helpers import modules_loaded


def test_the_audit_of_a_file_loads_no_engine_git_renderer_or_job() -> None:
    loaded = modules_loaded("audit", sys.executable)  # an ELF without device code
    own = {name for name in loaded if name.startswith("sm121_build")}
    assert "sm121_build.cuda.binary" in own and "sm121_build.audit.report" in own
    assert "docker" not in loaded
    for forbidden in ("sm121_build.image.engine", "sm121_build.source.git_pin",
                      "sm121_build.jobs", "sm121_build.jobs.formats.render",
                      "sm121_build.cli.build",
                      "sm121_build.verify.checks"):
        assert forbidden not in own, forbidden
    assert not {name for name in own if name.startswith("sm121_build.jobs")}


def test_a_command_module_is_loaded_when_its_command_runs() -> None:
    loaded = modules_loaded("patch", "--help")
    assert "sm121_build.cli.patch" in loaded
    assert "sm121_build.cli.build" not in loaded and "docker" not in loaded
