"""The engine's per-path reads on real images: inspect without an export, the created
container always removed, and the same answers as the folder stand-in gives."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import pytest

from devkit.dirfiles import DirectoryFiles, make_tree
from devkit.dockerenv import client_or_skip
from devkit.helpers import cli
from devkit.testtags import RUN
from sm121_build.core.errors import Sm121Error
from sm121_build.image.engine import READER_LABEL, Engine
from sm121_build.image.facts import facts_from_files
from sm121_build.verify.checks import image_torch_exports

pytestmark = pytest.mark.docker
VERSION_PY = b"__version__ = version = '0.17.0'\n__commit_id__ = commit_id = 'gb31e9326a'\n"
SITE = "opt/venv/lib/python3.12/site-packages"
TREE: dict[str, bytes | str] = {
    "opt/venv/bin/python3": "python3.12",
    "opt/venv/bin/python3.12": b"\x7fELF",
    "opt/venv/bin/vllm": b"#!/opt/venv/bin/python3\n",
    f"{SITE}/vllm/_version.py": VERSION_PY,
    f"{SITE}/vllm/_C.abi3.so": b"\x7fELF",
    f"{SITE}/vllm/_moe_C.abi3.so": b"\x7fELF",
    f"{SITE}/vllm/model_executor/x.abi3.so": b"\x7fELF",
    f"{SITE}/torch/version.py": b"__version__ = '2.11.0+cu130'\n",
    "usr/local/cuda-13.0/bin/nvcc": b"\x7fELF",
    "usr/local/cuda-13.0/include/cuda.h": b"#define CUDA_VERSION 13000\n",
    "usr/local/cuda": "cuda-13.0",
}
VenvImage = tuple[docker.DockerClient, Path, str]  # engine, folder, tag
CHANGES = ['ENV PATH=/opt/venv/bin:/usr/local/cuda/bin:/usr/bin:/bin',
           'ENTRYPOINT ["vllm", "serve"]']


@contextmanager
def imported(client: docker.DockerClient, root: Path, tag: str) -> Iterator[str]:
    """The folder as an image (`docker import` with the venv config), removed afterwards."""
    data = subprocess.run(["tar", "-C", str(root), "-c", "."], check=True,
                          capture_output=True).stdout
    repository, version = tag.split(":")
    client.api.import_image_from_data(data, repository=repository, tag=version,
                                      changes=CHANGES)
    try:
        yield tag
    finally:
        client.images.remove(tag, force=True)


@pytest.fixture
def venv_image(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[VenvImage]:
    """(engine, folder, tag): the venv tree as a folder and as an image, one per test."""
    client = client_or_skip()
    root = make_tree(tmp_path / "root", TREE)
    tag = f"{RUN}/reader-venv:{request.node.name[5:40].replace('_', '-')}"
    with imported(client, root, tag):
        yield client, root, tag


def _readers(client: docker.DockerClient) -> list[str]:
    return [c.id for c in client.containers.list(all=True, filters={"label": READER_LABEL})]


def test_engine_reads_agree_with_the_folder(venv_image: VenvImage) -> None:
    client, root, tag = venv_image
    engine = Engine.connect()
    info = engine.image(tag)
    expected = facts_from_files(info, DirectoryFiles(root))
    with engine.reader(info.id) as files:
        found = facts_from_files(info, files)
        assert files.canonical("/usr/local/cuda/bin/nvcc") == \
            "/usr/local/cuda-13.0/bin/nvcc"
        assert files.stat("/nope") is None
        stat = files.stat(f"/{SITE}/vllm")
        assert stat is not None and stat.is_dir
        with files.tar(f"/{SITE}/vllm") as archive:
            names = sorted(m.name for m in archive if m.isfile())
    assert found == expected
    assert found.vllm is not None
    assert found.vllm.extensions == ("_C.abi3.so", "_moe_C.abi3.so")
    assert (found.vllm.cuda_version, found.vllm.torch_version) == ("13.0", "2.11.0+cu130")
    assert "vllm/model_executor/x.abi3.so" in names
    assert _readers(client) == []


def test_reader_container_removed_on_error_and_on_interrupt(venv_image: VenvImage) -> None:
    client, _root, tag = venv_image
    engine = Engine.connect()
    image_id = engine.image(tag).id
    for error in (Sm121Error("boom"), KeyboardInterrupt()):
        with pytest.raises(type(error)), engine.reader(image_id) as files:
            assert files.stat("/usr") is not None
            assert len(_readers(client)) == 1
            raise error
        assert _readers(client) == []


def test_pin_reads_a_venv_image_from_its_config(venv_image: VenvImage, tmp_path: Path) -> None:
    client, _root, tag = venv_image
    result = cli("pin", "--json", tag, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)["vllm"]
    assert data["site_packages"] == f"/{SITE}" and data["python"] == "3.12"
    assert data["cuda_home"] == "/usr/local/cuda"
    assert _readers(client) == []
    # a damaged facts cache is read again, not a traceback
    for cached in (tmp_path / "cache" / "sm121-build" / "facts").glob("*.json"):
        cached.write_text("{not json")
    again = cli("pin", "--json", tag, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["vllm"] == data
    # an entry changed in the cache (valid JSON, another vLLM: a cache restored from
    # elsewhere) is not what this tool wrote: its digest in the state says so, read again
    for cached in (tmp_path / "cache" / "sm121-build" / "facts").glob("*.json"):
        poisoned = json.loads(cached.read_text())
        poisoned["vllm"]["version"] = "9.9.9"
        cached.write_text(json.dumps(poisoned, indent=2))
    trusted = cli("pin", "--json", tag, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert trusted.returncode == 0, trusted.stderr
    assert json.loads(trusted.stdout)["vllm"] == data


def test_image_removed_while_it_is_read_is_one_line(tmp_path: Path) -> None:
    client = client_or_skip()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    client.api.import_image_from_data(buffer.getvalue(), repository=f"{RUN}/reader-gone",
                                      tag="1")
    engine = Engine.connect()
    image_id = engine.image(f"{RUN}/reader-gone:1").id
    client.images.remove(f"{RUN}/reader-gone:1", force=True)
    with pytest.raises(Sm121Error, match="was removed from the engine while it was being "
                                         "read"), engine.reader(image_id):
        pass


def test_full_tmpdir_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    client = client_or_skip()
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MB tmpfs here: {mounted.stderr.decode().strip()}")
    tag = f"{RUN}/reader-big-so:1"
    root = make_tree(tmp_path / "root", {"opt/x/big.abi3.so": b"\x7fELF" + bytes(3 << 20)})
    try:
        with imported(client, root, tag):
            result = cli("audit", tag, "--include", "/opt/x/*", env={"TMPDIR": str(small)})
            assert result.returncode == 2, result.stderr
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1, lines
            assert lines[0].startswith(f"error: no space left in {small}/"), lines
            assert "point TMPDIR at a larger disk" in lines[0]
            assert list(small.iterdir()) == []
            assert _readers(client) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_audit_reads_only_the_included_folders(matrix: dict[str, Path], host_only_so: Path,
                                               tmp_path: Path) -> None:
    client = client_or_skip()
    host = host_only_so.read_bytes()
    tree = {**TREE, f"{SITE}/vllm/_C.abi3.so": matrix["sm121"].read_bytes(),
            f"{SITE}/vllm/_moe_C.abi3.so": host, f"{SITE}/vllm/model_executor/x.abi3.so": host,
            "srv/filler/other.abi3.so": matrix["sm90"].read_bytes(),
            "srv/filler/blob": bytes(8 << 20)}
    root = make_tree(tmp_path / "root", tree)
    tag = f"{RUN}/reader-venv:4"
    with imported(client, root, tag):
        scoped = cli("audit", "--json", tag, "--include", "*/vllm/*")
        assert scoped.returncode == 0, scoped.stderr
        names = {b["name"]: b["verdict"] for b in json.loads(scoped.stdout)["binaries"]}
        assert names == {f"/{SITE}/vllm/_C.abi3.so": "native",
                         f"/{SITE}/vllm/_moe_C.abi3.so": None,
                         f"/{SITE}/vllm/model_executor/x.abi3.so": None}
        whole = cli("audit", "--json", tag)
        assert whole.returncode == 0, whole.stderr
        every = {b["name"] for b in json.loads(whole.stdout)["binaries"]}
        assert "/srv/filler/other.abi3.so" in every and set(names) <= every
        absolute = cli("audit", "--json", tag, "--include", "/srv/*")
        assert {b["name"] for b in json.loads(absolute.stdout)["binaries"]} == {
            "/srv/filler/other.abi3.so"}
        assert _readers(client) == []


def test_torch_exports_are_read_through_the_engine(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine names tar members after the folder (`lib/libc10.so`), not by full path: the
    ABI check found no torch library in any real image until this was read that way."""
    client = client_or_skip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = make_tree(tmp_path / "root", TREE)
    lib = root / SITE / "torch" / "lib"
    lib.mkdir(parents=True)
    (lib / "c10.cpp").write_text("namespace c10 { int answer(int x) { return x + 1; } }\n")
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(lib / "libc10.so"),
                    str(lib / "c10.cpp")], check=True)
    (lib / "c10.cpp").unlink()
    with imported(client, root, f"{RUN}/reader-torch:1") as tag:
        engine = Engine.connect()
        image_id = engine.image(tag).id
        with engine.reader(image_id) as files:
            exported, libraries = image_torch_exports(files, image_id, f"/{SITE}", tmp_path)
    assert (exported, libraries) == ({"_ZN3c106answerEi"}, 1)
    assert (exported, libraries) == image_torch_exports(
        DirectoryFiles(root), "sha256:folder", f"/{SITE}", tmp_path)  # the stand-in agrees


def _children_removed(client: docker.DockerClient, image_id: str) -> None:
    """The images built on `image_id` (a test's own base), the newest first."""
    for image in client.api.images(all=True):
        if image.get("ParentId") == image_id:
            _children_removed(client, str(image["Id"]))
            client.images.remove(str(image["Id"]), force=True)


def test_the_legacy_builders_output_is_cut_into_lines_as_the_clis_is(
        venv_image: VenvImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legacy builder (`DOCKER_BUILDKIT=0`, through the API) hands its output as chunks:
    a step's echo of a 40 KiB instruction is one.  They reach the log and the status line
    through `core/children.Lines` as the CLI's output does: no line longer than
    `LINE_WIDTH`, and the engine's error is the failure's cause."""
    from sm121_build.core.children import LINE_WIDTH
    from sm121_build.core.errors import BuildFailed

    client, _root, tag = venv_image
    monkeypatch.setenv("DOCKER_BUILDKIT", "0")
    context = tmp_path / "context"
    context.mkdir()
    dockerfile = context / "Dockerfile"
    dockerfile.write_text(f"FROM {tag}\nLABEL big={'a' * 40 * 1024}\nCOPY missing-file /x\n")
    log = tmp_path / "build.log"
    shown: list[str] = []
    engine = Engine.connect()
    assert engine.buildkit_client() is None
    try:
        with pytest.raises(BuildFailed) as failed:
            engine.build(context, dockerfile, log, status=shown.append)
    finally:
        _children_removed(client, client.images.get(tag).id)
    lines = log.read_text().splitlines()
    assert max(len(line.encode()) for line in lines) <= LINE_WIDTH
    assert sum(len(line) for line in lines if set(line) == {"a"}) >= 40 * 1024 - LINE_WIDTH
    assert all(len(line.encode()) <= LINE_WIDTH for line in shown)
    assert "missing-file" in str(failed.value) and str(log) in str(failed.value)
