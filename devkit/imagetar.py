"""Write image tarballs the way `docker save` and OCI layouts shape them (for tests)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from devkit.testtags import image


@dataclass(frozen=True)
class HardLink:
    """A layer member that is a hard link to an earlier member (as `tar` writes a second
    name of one file)."""

    target: str


Layer = dict[str, "bytes | HardLink | None"]  # path -> content; None = directory


def _layer_tar(files: Layer) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, HardLink):
                info.type = tarfile.LNKTYPE
                info.linkname = content.target
                tar.addfile(info)
            elif content is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.size = len(content)
                info.mode = 0o755
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def docker_save(path: Path, layers: list[Layer], tag: str = image("fixture:1"),
                architecture: str = "arm64", labels: dict[str, str] | None = None,
                prefix: str = "") -> Path:
    """A tarball `docker load` accepts (for any architecture, no emulation needed);
    `prefix="./"` names the members as `tar -C dir .` does."""
    with tarfile.open(path, "w") as tar:
        names, diff_ids = [], []
        for number, files in enumerate(layers):
            data = _layer_tar(files)
            name = f"layer{number}/layer.tar"
            _add(tar, prefix + name, data)
            names.append(name)
            diff_ids.append("sha256:" + hashlib.sha256(data).hexdigest())
        config = json.dumps({
            "architecture": architecture, "os": "linux",
            "config": {"Labels": labels or {}, "Env": ["PATH=/usr/bin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        _add(tar, prefix + config_name, config)
        _add(tar, prefix + "manifest.json", json.dumps(
            [{"Config": config_name, "RepoTags": [tag], "Layers": names}]).encode())
    return path


def oci_layout(path: Path, layers: list[Layer], platforms: tuple[str, ...] = ("linux/arm64",),
               compress: bool = True) -> Path:
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    layer_descs = []
    for files in layers:
        data = _layer_tar(files)
        if compress:
            data = gzip.compress(data)
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                            "digest": blob(data), "size": len(data)})
    manifests = []
    for platform in platforms:
        os_name, arch = platform.split("/")
        config = blob(json.dumps({"os": os_name, "architecture": arch}).encode())
        manifest = json.dumps({"schemaVersion": 2, "config": {"digest": config},
                               "layers": layer_descs}).encode()
        manifests.append({"digest": blob(manifest), "platform":
                          {"os": os_name, "architecture": arch}})
    inner_index = blob(json.dumps({"schemaVersion": 2, "manifests": manifests}).encode())
    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps(
            {"schemaVersion": 2, "manifests": [{"digest": inner_index}]}).encode())
        for digest, data in blobs.items():
            _add(tar, "blobs/sha256/" + digest.split(":")[1], data)
    return path
