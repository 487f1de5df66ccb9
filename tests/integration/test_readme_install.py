"""The README's first command, as written, on a fresh Debian 12 (debootstrap minbase with
python3 and sudo, nothing else): apt, venv and pip run for real inside a container on the
host's network.  Only the main job at its end is left out (it needs a Spark's base image);
the installed command then runs `--version` and an audit of a small real `.so`.
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from devkit.dockerenv import client_or_skip, ensure_debian
from devkit.helpers import ROOT
from devkit.stockimage import stock_extensions
from devkit.testtags import cached

pytestmark = [pytest.mark.docker, pytest.mark.slow]

FRESH = cached("debian-fresh:bookworm")  # the suite's cache: reused by the next run
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def readme_install_line() -> tuple[str, str, str]:
    """(set-up part, the doctor step, main job) of the README's first bash block."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## On a fresh machine.*?```bash\n(.*?)\n```", text, re.S)
    assert block, "README has no set-up command"
    (line,) = block.group(1).strip().splitlines()
    rest, _, main_job = line.rpartition(" && ")
    setup, _, doctor = rest.rpartition(" && ")
    assert re.fullmatch(r"sm121-build --base \S+.*", main_job), main_job  # by name, on PATH
    assert doctor == "{ sm121-build doctor || [ $? = 1 ]; }", doctor  # a FAIL stops the run
    assert "'.[cuda]'" in setup  # NVIDIA's newest ptxas, not only a Spark's older one
    return setup, doctor, main_job


def _source_tarball(dest: Path) -> Path:
    """The repository's tracked files (what a clone has), as a tar for the container."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                           capture_output=True).stdout.decode().split("\0")
    tarball = dest / "src.tar"
    with tarfile.open(tarball, "w") as tar:
        for name in filter(None, files):
            if (ROOT / name).exists():
                tar.add(ROOT / name, arcname=f"src/{name}")
    return tarball


def test_readme_install_line_on_a_fresh_debian(tmp_path: Path) -> None:
    client = client_or_skip()
    image = ensure_debian(client, FRESH, "python3,sudo,ca-certificates")
    setup, _doctor, main_job = readme_install_line()
    installed = main_job.split()[0]  # `sm121-build`, by name: the line linked it on PATH
    so = stock_extensions() / "_C.abi3.so"
    tarball = _source_tarball(tmp_path)
    # doctor as the line runs it, but not stopping here: no engine in this container (FAIL)
    script = (f"set -e; tar -C /root -xf /in/src.tar; cd /root/src; {setup}; "
              f"{installed} doctor || true; "
              f"{installed} --version; {installed} audit /in/_C.abi3.so")
    volumes = {str(tarball): {"bind": "/in/src.tar", "mode": "ro"},
               str(so): {"bind": "/in/_C.abi3.so", "mode": "ro"}}
    environment = {"DEBIAN_FRONTEND": "noninteractive", "HOME": "/root"}
    if CA_BUNDLE.exists():  # this test machine's network may need its CA bundle for PyPI
        volumes[str(CA_BUNDLE)] = {"bind": "/in/ca.crt", "mode": "ro"}
        environment["PIP_CERT"] = "/in/ca.crt"
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy"):
        if os.environ.get(key):
            environment[key] = os.environ[key]
    container = client.containers.run(image, ["bash", "-c", script], network_mode="host",
                                      volumes=volumes, environment=environment, detach=True)
    try:
        status = container.wait(timeout=900)
        logs = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    assert status["StatusCode"] == 0, logs[-4000:]
    assert re.search(r"^sm121-build, version \S+$", logs, re.M), logs[-2000:]
    assert "_C.abi3.so" in logs and "sm_90" in logs
    assert "NO loadable code" in logs  # sm_90 cubins only: nothing for sm_121
    # the tools the set-up brought are found where it put them (the venv, `[cuda]`'s ptxas)
    assert re.search(r"^OK +host tools +cmake \S*\.sm121-build/bin/cmake", logs, re.M), logs
    assert re.search(r"^OK +aot ptxas +ptxas 13\.", logs, re.M), logs[-3000:]
