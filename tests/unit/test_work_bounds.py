"""Work that grows no faster than its input (issue #54): each hostile input is built at a
size N and 2N, and reading the 2N one may cost at most 2.5x the time (the best of three
runs, times under 50 ms counted as 50 ms: noise) or stay under a memory bound.

- `.rodata` whose candidate fatbin containers nest, each walked through the entries of all
  the later ones before it fails (quadratic search);
- a wheel of thousands of stored members (its central directory read once per member);
- an image whose RECORD is tens of MB of short rows (held as a list of lists);
- a fatbin of large honest zstd entries read by two threads (one entry each, at once)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from devkit.hostile import CONTAINER, ENTRY, elf_with, nested_rodata, stored_wheel
from devkit.imagetar import oci_layout
from sm121_build.audit.distributions import Owners
from sm121_build.audit.unpack import binaries
from sm121_build.core import inputs as core_inputs
from sm121_build.core.errors import CorruptBinaryError
from sm121_build.cuda.fatbin import CONTAINER_MAGIC, HostBinary

FLOOR = 0.05  # seconds: shorter times are noise
# what 4N may cost against N: linear work gives 4, quadratic 16 (twice N against N, bounded
# at 2.5, measured 2.7 and 3.1 on a CI rehearsal's 2 busy cores: too near to tell apart;
# 4N against N measured 4.0 to 5.1 there)
LINEAR_4N = 8.0  # half of what quadratic work costs
MiB = 1 << 20


def _best(call: Callable[[], object], runs: int = 3) -> float:
    """The least CPU time of this process (all its threads) `call` took in `runs` tries:
    not the wall clock, which other processes on the machine (a parallel test worker, a
    mutant's run) stretch, and a ratio of two of which flaked under contention."""
    times = []
    for _ in range(runs):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return min(times)


def _ratio(small: float, large: float) -> float:
    return max(large, FLOOR) / max(small, FLOOR)


def _peak(call: Callable[[], object]) -> int:
    """The most bytes Python held at once while `call` ran (every thread)."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- 1: nested candidate containers ---------------------------------------------------------
def _search(path: Path) -> int | None:
    try:
        with HostBinary.open(path) as binary:
            return len(binary.entries)
    except CorruptBinaryError:  # refused in one line: as good as read, for the time
        return None


def test_nested_candidate_containers_are_searched_in_linear_time(tmp_path: Path) -> None:
    small, large = tmp_path / "libn.so", tmp_path / "lib4n.so"
    small.write_bytes(nested_rodata(600))
    large.write_bytes(nested_rodata(2400))
    assert _search(small) in (0, None)  # no container in it holds together
    ratio = _ratio(_best(lambda: _search(small)), _best(lambda: _search(large)))
    assert ratio <= LINEAR_4N, f"4N costs {ratio:.1f}x N"


# -- 2: a wheel of many stored members ------------------------------------------------------
def _read(target: Path) -> int:
    with binaries(str(target)) as found:
        return len(found)


def test_a_wheel_of_many_stored_members_reads_its_directory_once(tmp_path: Path) -> None:
    small = stored_wheel(tmp_path / "small-1.0-py3-none-any.whl", 600)
    large = stored_wheel(tmp_path / "large-1.0-py3-none-any.whl", 2400)
    assert _read(small) == 0  # none of them is device code
    ratio = _ratio(_best(lambda: _read(small)), _best(lambda: _read(large)))
    assert ratio <= LINEAR_4N, f"4N costs {ratio:.1f}x N"


# -- 3: a RECORD of many short rows ---------------------------------------------------------
def _record(size: int) -> bytes:
    rows = []
    total = i = 0
    while total < size:
        rows.append(f"f{i:x},,\n".encode())
        total += len(rows[-1])
        i += 1
    return b"".join(rows)


@pytest.mark.parametrize("size", [2 * MiB, 4 * MiB])
def test_a_large_record_is_read_in_memory_of_its_size(tmp_path: Path, size: int) -> None:
    """An image whose RECORD is `size` bytes of short rows naming no binary: read in at
    most a few times its bytes (the RECORD itself is held while it is read), not as a list
    of millions of rows."""
    image = oci_layout(tmp_path / "image.tar", [{
        "usr/lib/python3/dist-packages/x-1.0.dist-info/RECORD": _record(size)}])
    peak = _peak(lambda: _read(image))
    assert peak < 4 * size + 8 * MiB, f"{peak / MiB:.0f} MiB for a {size / MiB:.0f} MiB RECORD"


def test_record_rows_that_name_binaries_still_give_their_owner() -> None:
    owners = Owners()
    owners.add_record("site/vllm-0.1.dist-info/RECORD",
                      b"vllm/_C.abi3.so,sha256=x,1\n" + _record(1 << 16))
    assert owners.owner("site/vllm/_C.abi3.so") == "vllm"
    assert owners.owner("site/vllm/./_C.abi3.so") == "vllm"


# -- 4: large honest zstd entries, read by two threads -------------------------------------
def _zstd_fatbin(count: int, size: int, kind: int = 2) -> bytes:
    """A raw fatbin of `count` zstd entries of `size` bytes each, compressed ~100x (within
    the 512x a reader allows each entry): cubins (kind 2, an ELF of one large section,
    held whole to be read) or PTX (kind 1, read a window at a time)."""
    text = bytearray(size - 512 if kind == 2 else size)
    text[::128] = os.urandom(len(text[::128]))
    payload = elf_with([(".text", bytes(text))]) if kind == 2 else bytes(text)
    frame = zstandard.ZstdCompressor(level=1).compress(payload)
    stored = len(frame) + (-len(frame) % 8)
    entry = ENTRY.pack(kind, 0x101, ENTRY.size, stored, len(frame), 0, 0, 8, 80, 0, 0,
                        0x11 | 0x8000, 0, len(payload)) + frame + bytes(stored - len(frame))
    body = entry * count
    return CONTAINER.pack(CONTAINER_MAGIC, 1, CONTAINER.size, len(body)) + body


def _kernels(path: Path) -> int:
    with HostBinary.open(path) as binary:
        return sum(1 for _ in binary.every_kernel(workers=2))


def test_what_a_run_holds_inflated_at_once_is_bounded(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 64 MiB cubin entries (held whole) under a 96 MiB budget: read one at a time,
    so the run holds about what one entry does, not one entry per thread."""
    monkeypatch.setattr(core_inputs, "INFLATE_BUDGET", 96 * MiB, raising=False)
    one, two = tmp_path / "one.fatbin", tmp_path / "two.fatbin"
    one.write_bytes(_zstd_fatbin(1, 64 * MiB))
    two.write_bytes(_zstd_fatbin(2, 64 * MiB))
    assert _kernels(two) == 2
    peak_one, peak_two = _peak(lambda: _kernels(one)), _peak(lambda: _kernels(two))
    assert peak_two < 96 * MiB, f"{peak_two / MiB:.0f} MiB held at once"
    assert peak_two <= 1.5 * peak_one, f"{peak_two / MiB:.0f} MiB vs {peak_one / MiB:.0f}"


def _ptx_fatbin(texts: list[bytes], cut: int = 0) -> bytes:
    """A raw fatbin of zstd PTX entries (each frame states its size); `cut`: the last
    bytes of each frame dropped (a frame cut short, its header's sizes kept honest)."""
    body = b""
    for text in texts:
        frame = zstandard.ZstdCompressor(level=1).compress(text)
        frame = frame[:len(frame) - cut]
        stored = len(frame) + (-len(frame) % 8)
        body += ENTRY.pack(1, 0x101, ENTRY.size, stored, len(frame), 0, 0, 8, 80, 0, 0,
                           0x11 | 0x8000, 0, len(text)) + frame + bytes(stored - len(frame))
    return CONTAINER.pack(CONTAINER_MAGIC, 1, CONTAINER.size, len(body)) + body


def _whole_text_kernels(text: bytes) -> list[str]:
    """The `.entry` names as the reader found them in the whole text before it streamed."""
    import re

    names, at = [], text.find(b".entry")
    while at >= 0:
        found = re.compile(rb"\.entry\s+([A-Za-z_$%][\w$]*)").match(text, at)
        if found:
            names.append(found.group(1).decode())
        at = text.find(b".entry", at + 6)
    return names


def test_ptx_entries_are_read_as_they_inflate_never_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #62: two honest 540 MB zstd PTX entries were each inflated whole to list their
    kernels.  Their names now come a window at a time: no whole-payload inflate is asked
    for, and the names are the whole text's, `.entry` lines cut by a window's end too."""
    window = core_inputs.WINDOW
    letters = bytes.maketrans(bytes(range(256)), bytes(97 + b % 26 for b in range(256)))
    texts = []
    for number in range(2):
        text = bytearray(b".version 8.0\n.target sm_80\n")
        # `.entry` starts this far before a window's end: cut in it, right after it, in the
        # space after it, in its name, or at the window's start
        for boundary, before in enumerate((3, 6, 8, 12, 0), start=1):
            filler = boundary * window - before - len(text)
            text += os.urandom(filler).translate(letters) + b".entry \t\n k%d_%d(\n)\n" % (
                number, before)
        texts.append(bytes(text))
    path = tmp_path / "ptx.fatbin"
    path.write_bytes(_ptx_fatbin(texts))

    def whole(*_args: object) -> bytes:
        raise AssertionError("a PTX entry was inflated whole")

    monkeypatch.setattr("sm121_build.cuda.fatbin.inflate", whole)
    monkeypatch.setattr(core_inputs, "inflate", whole)
    with HostBinary.open(path) as binary:
        found = [list(names) for _entry, names in binary.every_kernel(workers=2)]
    assert found == [_whole_text_kernels(t) for t in texts]
    assert all(len(names) == 5 for names in found), found


def test_a_ptx_frame_cut_short_is_refused_as_it_streams(tmp_path: Path) -> None:
    """The streaming decoder ends quietly where a frame's bytes end: the bytes it yields
    are counted against what the frame states."""
    path = tmp_path / "cut.fatbin"
    path.write_bytes(_ptx_fatbin([b".version 8.0\n.target sm_80\n" + os.urandom(3 * MiB)],
                                 cut=64 << 10))
    with HostBinary.open(path) as binary, pytest.raises(CorruptBinaryError,
                                                         match="does not decompress"):
        binary.kernels(binary.entries[0])


@pytest.mark.parametrize("seed", range(40))
def test_ptx_names_are_the_whole_texts_whatever_the_windows(seed: int) -> None:
    """`.entry`, spaces and names cut at every kind of place: the names found window by
    window are those of the whole text."""
    import random

    from sm121_build.cuda.fatbin import ptx_kernels_in

    rng = random.Random(seed)
    text = b"".join(rng.choice([b".entry", b" ", b"\n\t", b"k1", b"$x_", b"(", b".",
                                b"%r", b"entry", b"9"]) for _ in range(rng.randint(0, 200)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 30))))
    windows = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert list(ptx_kernels_in(w for w in windows if w)) == _whole_text_kernels(text)


# -- 6: what an image tarball's layers may write out -----------------------------------------
def _disk_peak(folder: Path, call: Callable[[], object]) -> tuple[int, BaseException | None]:
    """The most bytes (blocks on disk) `folder` held while `call` ran, and what it raised."""
    peak = [0]
    stop = threading.Event()

    def blocks(path: str) -> int:
        try:
            return os.lstat(path).st_blocks * 512
        except OSError:  # removed between the listing and the look
            return 0

    def watch() -> None:
        while not stop.is_set():
            used = sum(blocks(os.path.join(d, f))
                       for d, _dirs, files in os.walk(folder) for f in files)
            peak[0] = max(peak[0], used)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    raised: BaseException | None = None
    try:
        call()
    except CorruptBinaryError as exc:
        raised = exc
    finally:
        stop.set()
        watcher.join()
    return peak[0], raised


@pytest.mark.parametrize("links", [0, 60], ids=["one-member", "hard-links"])
def test_an_image_tarballs_layers_write_out_a_bounded_multiple_of_it(
        tmp_path: Path, links: int, monkeypatch: pytest.MonkeyPatch,
        jit_only_so: Path) -> None:
    """Red team round 5: a 0.3 MB tarball whose .so has 60 hard links wrote 1.34 GB (each
    link a full copy); a 1.8 MB one with one member of zeros wrote 1.55 GB.  What the
    wanted files hold in all (links counted) is bounded by `MAX_RATIO` times the tarball,
    past the floor; a link is the same inode on disk."""
    from devkit.imagetar import HardLink

    padded = jit_only_so.read_bytes() + bytes((30 if links else 200) * MiB)
    pkg = "usr/lib/python3/dist-packages/pkg"
    layer: dict[str, bytes | HardLink | None] = {f"{pkg}/base.so": padded}
    layer.update({f"{pkg}/l{k}.so": HardLink(f"{pkg}/base.so") for k in range(links)})
    image = oci_layout(tmp_path / "image.tar", [layer])
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setenv("TMPDIR", str(work))
    monkeypatch.setattr(tempfile, "tempdir", None)
    bound = core_inputs.MAX_RATIO * image.stat().st_size + core_inputs.RATIO_FLOOR
    peak, raised = _disk_peak(work, lambda: _read(image))
    assert raised is not None and "a decompression bomb" in str(raised), raised
    assert peak <= bound + 2 * MiB, f"{peak / MiB:.0f} MiB on disk, bound {bound / MiB:.0f}"
    assert list(work.iterdir()) == []


def test_an_honest_hard_link_is_read_as_its_file(tmp_path: Path, jit_only_so: Path) -> None:
    """The bound takes nothing from an image with a few linked libraries: each name is
    audited, and on disk the link shares its file's blocks."""
    from devkit.imagetar import HardLink

    pkg = "usr/lib/python3/dist-packages/pkg"
    image = oci_layout(tmp_path / "image.tar", [{
        f"{pkg}/a.so": jit_only_so.read_bytes(), f"{pkg}/b.so": HardLink(f"{pkg}/a.so")}])
    with binaries(str(image)) as found:
        named = {Path(b.name).name: b.path for b in found}
        assert set(named) == {"a.so", "b.so"}
        assert os.stat(named["a.so"]).st_ino == os.stat(named["b.so"]).st_ino


def test_a_layer_of_many_members_is_read_in_linear_time(tmp_path: Path) -> None:
    """Red team round 6: each member of a layer scanned every file listed before it (20,000
    empty files, 125 KB of tarball: 12.4 s).  Four times the members cost about four times
    (16 times, were it quadratic; a CI rehearsal on 2 busy cores measured 2.7 for twice
    the members, past a bound of 2.6: the wider step leaves room for the noise)."""
    def image(count: int) -> Path:
        return oci_layout(tmp_path / f"many-{count}.tar",
                          [{f"usr/share/d{i % 50}/f{i}.txt": b"" for i in range(count)}])

    small, large = image(4000), image(16000)
    ratio = _ratio(_best(lambda: _read(small)), _best(lambda: _read(large)))
    assert ratio <= LINEAR_4N, f"4N members cost {ratio:.1f}x N"


def test_whiteouts_remove_what_they_name_and_only_that(tmp_path: Path,
                                                       jit_only_so: Path) -> None:
    """The folder index that makes removal linear keeps the OCI rules: `.wh.NAME` removes
    NAME and all below it, `.wh..wh..opq` what lower layers put in its folder."""
    pkg = "usr/lib/python3/dist-packages"
    so = jit_only_so.read_bytes()
    image = oci_layout(tmp_path / "wh.tar", [
        {f"{pkg}/a/x.so": so, f"{pkg}/a/sub/y.so": so, f"{pkg}/b/z.so": so,
         f"{pkg}/c/w.so": so, f"{pkg}/ab.so": so},
        {f"{pkg}/.wh.a": b"", f"{pkg}/c/.wh..wh..opq": b"", f"{pkg}/c/v.so": so}])
    with binaries(str(image)) as found:
        names = sorted(b.name.split("dist-packages/")[1] for b in found)
    assert names == ["ab.so", "b/z.so", "c/v.so"]


@pytest.mark.parametrize("order", ["file-first", "whiteout-first"])
def test_a_whiteout_never_hides_its_own_layers_files(tmp_path: Path, jit_only_so: Path,
                                                     order: str) -> None:
    """Red team round 7: `opt/lib/evil.so` and `opt/lib/.wh..wh..opq` in one layer: the
    audit saw no file, the engine (docker load, export) keeps it.  A whiteout hides what
    lower layers hold, in whatever order its layer lists them."""
    so = jit_only_so.read_bytes()
    top: dict[str, bytes | None] = {"opt/lib/.wh..wh..opq": b"", "opt/lib/evil.so": so,
                                    "opt/lib/.wh.mine.so": b"", "opt/lib/mine.so": so}
    if order == "file-first":
        top = dict(reversed(list(top.items())))
    image = oci_layout(tmp_path / "same.tar", [{"opt/lib/lower.so": so}, top])
    with binaries(str(image)) as found:
        assert sorted(Path(b.name).name for b in found) == ["evil.so", "mine.so"]


def test_a_childs_output_of_many_short_lines_is_parsed_in_linear_time() -> None:
    """Red team 11: a child's output was cut into lines by copying the rest of the chunk
    after each line (`core.children.Lines`): a chunk of 64 KiB of newlines was 2 GiB of
    copies, and `prove IMAGE`'s whole container log, given at once (`heard`), 1 MiB of
    newlines 44 s.  What a hostile library prints on the harness's stdout is this input:
    four times the lines cost about four times."""
    from sm121_build.jobs.proofs.prove_child import Asked, heard

    def parse(count: int) -> None:
        said = heard(b"\n" * count, Asked(), "the hostile child")
        assert said.lines == count and said.ignored == count

    ratio = _ratio(_best(lambda: parse(1 << 17)), _best(lambda: parse(1 << 19)))
    assert ratio <= LINEAR_4N, f"4N lines cost {ratio:.1f}x N"


def test_a_log_line_that_never_ends_is_cut_in_linear_time() -> None:
    """A log followed line by line (`core.children.Lines`, no `on_cut`) cuts a line that
    never ends at its width and goes on; each cut searched the rest of the chunk for a
    newline again (a 4 MiB line cut every 100 bytes: 40,000 searches of megabytes).  Four
    times the bytes cost about four times."""
    from sm121_build.core.children import Lines

    def cut(size: int) -> None:
        lines: list[str] = []
        Lines(lines.append, 100)(b"x" * size)
        assert len(lines) == size // 100

    ratio = _ratio(_best(lambda: cut(1 << 20)), _best(lambda: cut(1 << 22)))
    assert ratio <= LINEAR_4N, f"4N bytes cost {ratio:.1f}x N"


def test_a_build_line_of_spaces_is_read_for_progress_in_linear_time() -> None:
    """Red team 12: every line of a build's output is read for ninja's `[n/N]` counter
    (`CompileProgress.feed`, the live line of the main job and `local`), whose pattern's lazy
    description (`(\\S.*?)\\s*$`) tried the rest of the line at each character: one 16 KiB
    line (the width a log line is cut at) of `[1/2] a`, spaces and `b` held the build's
    output for 1.5 s.  Four times the spaces cost about four times."""
    from sm121_build.core.compile_progress import CompileProgress

    def feed(spaces: int) -> None:
        progress = CompileProgress()
        assert progress.feed("[1/2] a" + " " * spaces + "b  \n", 0.0)
        assert progress.phases[0].starts == [(0.0, "a" + " " * spaces + "b")]

    ratio = _ratio(_best(lambda: feed(1 << 12)), _best(lambda: feed(1 << 14)))
    assert ratio <= LINEAR_4N, f"4N spaces cost {ratio:.1f}x N"


def test_a_failed_builds_log_is_read_for_its_cause_in_linear_time(tmp_path: Path) -> None:
    """Red team 12: a failed build's log is read for ptxas's message (`failure_cause`), whose
    pattern `ptxas.*error.*` tried the rest of a line from every `ptxas` in it: a 16 KiB line
    of them cost 0.4 s, and a log of thousands of such lines held the run's one error line
    for an hour.  Four times the line costs about four times; what is said is unchanged."""
    from sm121_build.image.engine import failure_cause

    def cause(size: int) -> None:
        log = tmp_path / f"build-{size}.log"
        log.write_text("Ptxas" * size + " sm121-build: " * size + "\n")
        assert failure_cause(log) == "see the log"

    ratio = _ratio(_best(lambda: cause(1 << 11)), _best(lambda: cause(1 << 13)))
    assert ratio <= LINEAR_4N, f"4N bytes cost {ratio:.1f}x N"
    log = tmp_path / "build.log"
    log.write_text("a ptxas b PTXAS x Error: y\nz sm121-build: q sm121-build: r failed\n")
    assert failure_cause(log) == "q sm121-build: r failed; ptxas said: ptxas b PTXAS x Error: y"
