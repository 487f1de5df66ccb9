"""Audit targets: directories, wheels, docker-save and OCI tarballs (whiteouts applied)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from devkit.helpers import cli
from devkit.imagetar import docker_save, oci_layout
from sm121_build.audit.unpack import Reading, binaries
from sm121_build.core.errors import Sm121Error


def _layers(matrix: dict[str, Path]) -> list[dict[str, bytes | None]]:
    sm90 = matrix["sm90"].read_bytes()
    sm121 = matrix["sm121"].read_bytes()
    return [
        {"usr/": None, "usr/lib/": None, "usr/lib/a.so": sm90, "opt/x/old.so": sm90,
         "opt/y/keep.so": sm90, "opt/y/sub/deep.so": sm90, "etc/readme.txt": b"hi"},
        {"usr/lib/a.so": sm121, "opt/x/.wh.old.so": b"", "opt/y/.wh..wh..opq": b"",
         "opt/y/new.so": sm121},
    ]


def _found(target: Path, **kwargs: object) -> dict[str, bytes]:
    with binaries(str(target), Reading(**kwargs)) as found:  # type: ignore[arg-type]
        return {b.name: b.path.read_bytes() for b in found}


def test_docker_save_applies_whiteouts(matrix: dict[str, Path], tmp_path: Path) -> None:
    tar = docker_save(tmp_path / "img.tar", _layers(matrix))
    found = _found(tar)
    assert sorted(found) == ["/opt/y/new.so", "/usr/lib/a.so"]
    assert found["/usr/lib/a.so"] == matrix["sm121"].read_bytes()


def test_oci_layout_picks_platform(matrix: dict[str, Path], tmp_path: Path) -> None:
    tar = oci_layout(tmp_path / "oci.tar", _layers(matrix), ("linux/arm64", "linux/amd64"))
    with pytest.raises(Sm121Error, match="several platforms"):
        _found(tar)
    assert sorted(_found(tar, platform="linux/arm64")) == ["/opt/y/new.so", "/usr/lib/a.so"]


def test_include_filter(matrix: dict[str, Path], tmp_path: Path) -> None:
    tar = oci_layout(tmp_path / "oci.tar", _layers(matrix))
    assert sorted(_found(tar, include=("*/usr/*", "usr/*"))) == ["/usr/lib/a.so"]


def test_temp_files_removed(matrix: dict[str, Path], tmp_path: Path) -> None:
    tar = docker_save(tmp_path / "img.tar", _layers(matrix))
    with binaries(str(tar)) as found:
        unpacked = found[0].path
        assert unpacked.exists()
    assert not unpacked.exists()


def test_wheel(matrix: dict[str, Path], tmp_path: Path) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-linux_aarch64.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(matrix["sm121"], "pkg/_C.abi3.so")
        zf.write(matrix["sm90"], "pkg/sub/_moe_C.abi3.so")
        zf.writestr("pkg/__init__.py", "")
    result = cli("audit", "--json", str(wheel))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    verdicts = {b["name"]: b["verdict"] for b in data["binaries"]}
    assert verdicts == {"pkg/_C.abi3.so": "native", "pkg/sub/_moe_C.abi3.so": "none"}


def test_directory_and_require(matrix: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "good.so").write_bytes(matrix["sm121"].read_bytes())
    (tmp_path / "lib" / "notes.txt").write_text("x")
    ok = cli("audit", "--require", "native", str(tmp_path / "lib"))
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "lib" / "bad.so").write_bytes(matrix["sm90"].read_bytes())
    bad = cli("audit", "--require", "native", str(tmp_path / "lib"))
    assert bad.returncode == 1
    assert "4 kernel(s) would not load as native on sm_121" in bad.stderr
    assert cli("audit", "--require", "native", "--target", "sm_90",
               str(tmp_path / "lib" / "bad.so")).returncode == 0


def test_not_an_image_tarball(tmp_path: Path) -> None:
    import tarfile

    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:
        tar.add(__file__, "x.py")
    result = cli("audit", str(plain))
    assert result.returncode == 2
    assert "not a docker-save or OCI image tarball" in result.stderr
