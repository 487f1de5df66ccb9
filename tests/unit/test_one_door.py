"""One way in: no module of the package opens, maps or reads a file by itself but
`core/inputs.py` (and `core/outputs.py`, the way out), except the calls listed here, each
with why it is not an input from outside (the tool's own shipped data, a file this run wrote
in its own temp folder, a handle the door already opened).  A new `open()` of an input fails
this test until it goes through the door, or is listed here with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sm121_build"
READS = {"open", "read_text", "read_bytes", "mmap", "ZipFile", "is_zipfile"}
DOORS = {"core/inputs.py", "core/outputs.py"}
# runs inside the builder container, on the standard library only (a contract forbids any
# import of the package): its inputs are the image's own files
OUTSIDE = {"jobs/payload/build_extensions.py",
           # `prove`'s children, run by the user's interpreter on the GPU's machine: the
           # standard library and torch only (the same contract); they print JSON lines
           # the job parses, and read the cubins and list the job wrote for them
           "jobs/payload/load_cubins.py", "jobs/payload/harness_fa2.py",
           "jobs/payload/harness_marlin.py", "jobs/payload/compare_outputs.py",
           "jobs/payload/harness_run.py", "jobs/payload/fa2_kernels.py",
           "jobs/payload/marlin_kernels.py", "jobs/payload/case_files.py"}

# (module, the call's source text) -> why it is not an input from outside
ALLOWED: dict[tuple[str, str], str] = {
    ("audit/unpack.py", "HostBinary.open(path)"): "the door itself (open_regular)",
    ("cuda/binary.py", "HostBinary.open(path)"): "the door itself (open_regular)",
    ("verify/checks.py", "HostBinary.open(path)"): "the door itself (open_regular)",
    ("audit/unpack.py", 'open(target, "wb")'): "writes the member to the run's temp folder",
    ("cuda/wheel.py", "wheel.open(info)"): "a member of a wheel the door opened",
    ("audit/unpack.py", "zipfile.is_zipfile(handle)"): "a file the door opened",
    ("audit/unpack.py", "zipfile.ZipFile(handle)"): "a wheel the door opened",
    ("cuda/added.py", "HostBinary.open(stock)"): "the door itself (open_regular)",
    ("cuda/added.py", "HostBinary.open(new)"): "the door itself (open_regular)",
    ("cuda/fatbin.py", "mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)"):
        "maps a descriptor open_regular gave",
    ("cuda/dynsym.py", "mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)"):
        "maps a descriptor open_regular gave",
    ("cuda/host.py", "mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)"):
        "maps a descriptor open_regular gave",
    ("core/children.py", "task.read_text()"):
        "/proc/self/task/*/children: this process's own children, from the kernel",
    ("cli/__init__.py", "os.open(os.devnull, os.O_WRONLY)"): "/dev/null, for writing",
    ("cli/local.py", "zipfile.is_zipfile(cutlass)"):
        "`local` builds the tree the user asked for on this host, on purpose",
    ("core/compile_progress.py", "item.read_text()"): "the package's shipped timings",
    ("core/shipped.py", 'resources.files("sm121_build").joinpath("data", name).read_text()'):
        "the package's shipped data",
    ("cuda/compat.py",
     'resources.files("sm121_build").joinpath("data/ptx_isa.yaml").read_text()'):
        "the package's shipped data",
    ("cuda/compat.py",
     'resources.files("sm121_build").joinpath("data/gpus.yaml").read_text()'):
        "the package's shipped data",
    ("verify/checks.py", 'resources.files("sm121_build").joinpath("data/left_out.yaml")'):
        "the package's shipped data",
    ("jobs/formats/render.py", "(templates_dir() / name).read_text()"):
        "the package's shipped templates",
    ("jobs/formats/render.py", "path.read_bytes()"): "the package's shipped templates",
    ("jobs/framework/cmake_sandbox.py", '(shipped_dir("dockerfiles") / DOCKERFILE)'):
        "the package's shipped Dockerfile",
    ("source/guard_rules.py", "path.read_text()"): "the package's shipped guard rules",
    ("source/guard_rules.py", "target.read_bytes()"):
        "the file this run is about to replace, kept to roll back (a regular file: "
        "real_file resolved it inside the tree)",
    ("image/engine.py", 'open(log, "a", encoding="utf-8")'): "the run's own log",
    ("image/engine.py", "iidfile.read_text()"): "docker build's --iidfile in the temp folder",
    ("image/engine.py", 'tarfile.open(fileobj=stream, mode="r|", bufsize=STREAM_READ)'):
        "the engine's answer, streamed with its limits",
    ("image/layers.py", 'tarfile.open(fileobj=handle, mode="r|*")'):
        "a layer of a tarball the door opened",
    ("image/layers.py", 'tarfile.open(fileobj=stream, mode="r|")'):
        "a layer of a tarball the door opened",
    ("image/layers.py", "tarfile.open(fileobj=cast(BinaryIO, _Capped(tarball, archive))"):
        "the tarball the door opened, its reads capped",
    ("image/layers.py", "json.load(handle)"): "a member of a tarball the door opened, bounded",
    ("image/layers.py", 'open(target, "wb")'): "writes a file to the run's temp folder",
    ("image/spill.py", 'open(dest, "wb")'): "writes a file to the run's temp folder",
    ("jobs/aot_work/aot_files.py", "zipfile.ZipFile(handle)"): "a wheel the door opened",
    ("cuda/wheel.py", 'zipfile.ZipFile(out, "w")'): "the result, written by the door",
    ("cuda/wheel.py", 'copy.open(info, "w")'): "the result, written by the door",
    ("jobs/formats/artifacts.py", 'open(dest / name, "wb")'):
        "the copy into the run's build context",
    ("verify/checks.py", 'open(log, "a", encoding="utf-8")'): "the run's own log",
}


def _reads(root: Path = PACKAGE) -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module in DOORS | OUTSIDE:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and \
                isinstance(func.value, ast.Name) else ""
            if owner == "files":  # an image's files: the engine's reader, with a size limit
                continue
            if name in READS or (name == "load" and owner == "json") or \
                    (name == "open" and owner in ("tarfile", "os")):
                source = ast.get_source_segment(text, node) or name
                found.append((module, " ".join(source.split()), node.lineno))
    return found


def test_every_input_is_opened_by_the_door() -> None:
    strays = [f"{module}:{line}: {call}" for module, call, line in _reads()
              if not any(module == m and call.startswith(c) for m, c in ALLOWED)]
    assert not strays, "open these through core/inputs.py (or list them with why):\n" + \
        "\n".join(strays)


def test_every_allowed_call_is_still_there() -> None:
    """A listed call that went away is taken off the list (the list says what is true)."""
    calls = _reads()
    stale = [key for key in ALLOWED
             if not any(module == key[0] and call.startswith(key[1])
                        for module, call, _ in calls)]
    assert not stale, stale


def test_the_scan_sees_a_stray_open(tmp_path: Path) -> None:
    """The scan is not blind: every kind of read it must find, in a package of its own."""
    (tmp_path / "stray.py").write_text(
        'import json, mmap, os, tarfile, zipfile\nopen("x")\nPath("x").read_bytes()\n'
        'Path("x").read_text()\ntarfile.open("x")\njson.load(f)\nos.open("x", 0)\n'
        'mmap.mmap(3, 0)\nzipfile.ZipFile("x")\n')
    found = [call for _, call, _ in _reads(tmp_path)]
    assert found == ['open("x")', 'Path("x").read_bytes()', 'Path("x").read_text()',
                     'tarfile.open("x")', "json.load(f)", 'os.open("x", 0)', "mmap.mmap(3, 0)",
                     'zipfile.ZipFile("x")'], found


SIGNING = {"image/cosign.py", "image/signed_files.py"}


def _signing_calls(source: str) -> list[str]:
    """Each `X.sign(...)`/`X.signed(...)` call, each `".sig"` text built and each read of
    COSIGN_PASSWORD in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("sign", "signed") and not (
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "cosign"):
            found.append(f"{node.func.attr}() at line {node.lineno}")
        if isinstance(node, ast.Constant) and node.value in (".sig", "COSIGN_PASSWORD"):
            found.append(f"{node.value!r} at line {node.lineno}")
    return found


def test_a_signature_is_made_and_checked_in_one_place() -> None:
    """Issue 61: a file's signature (`FILE.sig`) is written and checked by
    image/signed_files.py, a registry's by image/cosign.py, and the key's passphrase read
    from COSIGN_PASSWORD by cli/params.signing_key, nowhere else."""
    package = Path(__file__).resolve().parents[2] / "sm121_build"
    stray = {}
    for path in package.rglob("*.py"):
        name = path.relative_to(package).as_posix()
        calls = _signing_calls(path.read_text())
        if name == "cli/params.py":
            calls = [c for c in calls if not c.startswith("'COSIGN_PASSWORD'")]
        if calls and name not in SIGNING:
            stray[name] = calls
    assert stray == {}
    assert _signing_calls("key.sign(body)\nopen(p + '.sig')\nos.environ['COSIGN_PASSWORD']\n")
