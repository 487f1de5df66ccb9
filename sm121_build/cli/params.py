"""Command-line inputs checked before any work: arch lists, extension names, job counts.

Each check is a click callback raising `click.BadParameter`, which the CLI prints as one
`error:` line (exit 2).  What cannot give sm_121 loadable code, what would escape the build
context or inject a Dockerfile instruction, and what a compiler would reject only after an
hour are refused here.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from sm121_build.core.errors import Sm121Error
from sm121_build.core.outputs import declare_input, not_regular
from sm121_build.cuda.binary import Policy, gpu_policy
from sm121_build.cuda.compat import (
    DEFAULT_ARCH,
    DEFAULT_GPU,
    DEFAULT_TARGET,
    KNOWN_ARCHS,
    ArchList,
    arch_list_items,
    cubin_loads,
    dotted_arch,
    known_in_order,
    parse_cuda_version,
    parse_target,
)

if TYPE_CHECKING:
    from sm121_build.image.cosign import SigningKey

ARCH_ENTRY = re.compile(r"^(\d{1,2}\.\d)([af]?)(\+PTX)?\Z")
F = TypeVar("F", bound=Callable[..., Any])
EXTENSION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.abi3)?(?:\.[A-Za-z0-9_-]+)?(?:\.so)?\Z")


def arch_list(ctx: click.Context | None, param: click.Parameter | None,
              value: str) -> ArchList:
    """A TORCH_CUDA_ARCH_LIST of real archs with at least one that sm_121 loads natively."""
    if not value.isprintable():  # a newline would reach the Dockerfile as an instruction
        raise click.BadParameter(f"{value!r} holds a control character: expected e.g. "
                                 f"{DEFAULT_ARCH} or "
                                 f"12.0;{DEFAULT_ARCH}a")
    items = arch_list_items(value)
    if not items:
        raise click.BadParameter(f"the arch list is empty: expected e.g. {DEFAULT_ARCH} or "
                                 f"{DEFAULT_ARCH}a")
    for item in items:
        match = ARCH_ENTRY.match(item)
        if match is None or match.group(1) not in KNOWN_ARCHS:
            known = ", ".join(known_in_order())
            raise click.BadParameter(f"{item!r} is not a CUDA architecture (known: {known}; "
                                     "suffix a or f, or +PTX)")
    native = [i for i in items if (parsed := dotted_arch(i.replace("+PTX", ""))) is not None
              and cubin_loads(*parsed, DEFAULT_TARGET)]
    if not native:
        raise click.BadParameter(
            f"{value!r} gives {DEFAULT_TARGET} no native code (its cubins cannot load there): "
            f"include {DEFAULT_ARCH}, {DEFAULT_ARCH}a or 12.0f")
    return ArchList.parse(value)  # one value from here on: `12.0f,12.1` is `12.0f;12.1`


def optional_arch_list(ctx: click.Context | None, param: click.Parameter | None,
                       value: str | None) -> ArchList | None:
    """`--arch` where its default depends on `--gpu`: None when not given."""
    return None if value is None else arch_list(ctx, param, value)


GPU_HELP = (f"The GPU the result serves: {DEFAULT_GPU} (DGX Spark, GB10), sm_120 (RTX "
            "50-series, RTX PRO Blackwell), sm_110 (Jetson Thor), sm_90 (Hopper), ...  Its "
            "kernels are judged, compiled and verified for it, and its images are tagged "
            f"-smXYZ.  A GPU other than {DEFAULT_GPU} gets aot only (the guard rules of a "
            f"source build are written for {DEFAULT_GPU}).")


def gpu_value(ctx: click.Context | None, param: click.Parameter | None,
              value: str) -> Policy:
    """`--gpu sm_120` (`12.0`, `120`) as the run's GPU, judged with a CUDA 13.0 driver."""
    try:
        return gpu_policy(value)
    except Sm121Error as exc:
        raise click.BadParameter(str(exc)) from None


def gpu_name(ctx: click.Context | None, param: click.Parameter | None,
             value: str | None) -> str | None:
    """`--target` where its default is this machine's GPU: None when not given, else the
    GPU's name (`sm_120`), one of `compat.KNOWN_ARCHS`, checked before any work."""
    if value is None:
        return None
    try:
        return str(parse_target(value))
    except Sm121Error as exc:
        raise click.BadParameter(str(exc)) from None


def cuda_version(ctx: click.Context | None, param: click.Parameter | None,
                 value: str | None) -> str | None:
    """`--driver`, `--cuda`: a CUDA version (`13.0`), checked before any work."""
    if value is not None:
        try:
            parse_cuda_version(value)
        except Sm121Error as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def gpu_option() -> Callable[[F], F]:
    """`--gpu`, the same option on every command that makes or places kernels."""
    return click.option("--gpu", default=DEFAULT_GPU, show_default=True, callback=gpu_value,
                        help=GPU_HELP)


def arch_for_gpu(arch: ArchList | None, gpu: Policy) -> ArchList:
    """The arch list a run records: `--arch` (a source build: sm_121 alone) or the GPU's
    own (`12.0` for sm_120)."""
    if gpu.has_source_rules:
        return arch or ArchList.parse(DEFAULT_ARCH)
    if arch is not None and arch != gpu.arch_list:
        raise click.BadParameter(f"--arch {arch} is a source build's arch list, and a source "
                                 f"build is for {DEFAULT_GPU} only; --gpu {gpu} gets aot, for "
                                 f"{gpu.arch_list}", param_hint="--arch")
    return gpu.arch_list


def extension_names(ctx: click.Context | None, param: click.Parameter | None,
                    value: tuple[str, ...]) -> tuple[str, ...]:
    """Extension names are plain file or CMake target names: no path, no whitespace."""
    for name in value:
        if not EXTENSION_NAME.match(name) or ".." in name:
            raise click.BadParameter(
                f"{name!r} is not an extension name (a CMake target such as _moe_C or a file "
                "name such as _moe_C.abi3.so; no path, no spaces)")
    return value


class Count(click.ParamType[int]):
    """A whole number from `low` to `high`, in ASCII decimal digits: click's own int takes
    what Python's int() takes (`1_0`, Arabic-Indic and fullwidth digits, spaces around)."""

    name = "integer"

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            number = value
        elif not (isinstance(value, str) and _DIGITS.fullmatch(value)):
            self.fail(f"{value!r}: expected a whole number from {self.low} to {self.high} "
                      "in the digits 0-9", param, ctx)
        else:
            number = int(value)
        if not self.low <= number <= self.high:
            self.fail(f"{number} is not in the range {self.low}-{self.high}", param, ctx)
        return number


_DIGITS = re.compile(r"[0-9]{1,9}", re.ASCII)
JOBS = Count(1, 4096)


_PLATFORM = re.compile(r"[a-z0-9]{1,32}/[a-z0-9_]{1,32}(?:/[a-z0-9]{1,16})?", re.ASCII)


def platform_value(ctx: click.Context | None, param: click.Parameter | None,
                   value: str | None) -> str | None:
    """An OCI platform (`linux/arm64`, `linux/arm64/v8`), checked before any work."""
    if value is not None and not _PLATFORM.fullmatch(value):
        raise click.BadParameter(f"{value!r}: expected OS/ARCH or OS/ARCH/VARIANT, as "
                                 "linux/arm64 or linux/arm64/v8")
    return value


def seconds_value(ctx: click.Context | None, param: click.Parameter | None,
                  value: str) -> float:
    """A duration option (`--timeout`): `core.limits.seconds`, the rule the environment's
    limits keep (finite, above 0, at most a day), checked before any work."""
    from sm121_build.core.limits import seconds

    try:
        return seconds(str(value))
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: {exc}") from None


def require_writable(path: Path | None, option: str, *, directory: bool = False) -> None:
    """Fail now, not after an hour's build, when an output cannot be written."""
    if path is None:
        return
    folder = path if directory else path.parent
    what = None if directory else not_regular(path)
    if what and what != "a directory":
        raise Sm121Error(f"{option} {path}: is {what}; name a regular file (it is replaced or "
                         "appended to)")
    try:
        if path.exists() and path.is_dir() != directory:
            kind = "a directory" if path.is_dir() else "a file"
            raise Sm121Error(f"{option} {path}: is {kind}")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".sm121-probe-"):
            pass
        if not directory and path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied", str(path))
    except OSError as exc:
        raise Sm121Error(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None


def require_outputs(out: Path | None, report: Path | None, summary_md: Path | None,
                    inputs: tuple[Path | None, ...] = ()) -> None:
    """--out, --report, --summary-md and the cache dir, checked before any work: each
    writable, and none of them an input of the command (`inputs`: its files and folders,
    keys included) by any spelling, nor inside one."""
    from sm121_build.core.outputs import refuse_onto_inputs
    from sm121_build.core.paths import cache_dir, state_dir

    given = tuple(path for path in inputs if path is not None)
    for path, option in ((out, "--out"), (report, "--report"), (summary_md, "--summary-md")):
        if path is not None:
            refuse_onto_inputs(path, given, option)
    require_writable(out, "--out", directory=True)
    require_writable(report, "--report")
    require_writable(summary_md, "--summary-md")
    require_writable(cache_dir(), "cache dir (XDG_CACHE_HOME)", directory=True)
    require_writable(state_dir(), "state dir (XDG_STATE_HOME)", directory=True)


class InputPath(click.Path):
    """A path option the command READS (a key, a folder of files, a proof): declared an
    input of the outputs door (`core.outputs.declare_input`), so no output of the command
    (`--json`, `--out`, `--report`, ...) is written over, into or through it.  Every path
    option that is not an output is one of these (tests/unit/test_prove_doors.py)."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        declare_input(Path(os.fsdecode(path)), ctx)
        return path


def interpreter_value(ctx: click.Context | None, param: click.Parameter | None,
                      value: str) -> str:
    """`--python`: an interpreter the command runs, found as the shell finds it (a path, or
    a name on PATH); where it is a file here, an input (no output is written over it)."""
    found = shutil.which(value) if value else None
    if found is not None:
        declare_input(Path(found), ctx)
    return value


KEY_FILE = InputPath(dir_okay=False, exists=True, path_type=Path)


def sign_key_option(help_text: str, required: bool = False) -> Callable[[F], F]:
    """`--sign-key KEY` (an ECDSA P-256 PEM private key; its passphrase from
    COSIGN_PASSWORD), the same option on every command that signs; `help_text` says what it
    signs there."""
    return click.option("--sign-key", type=KEY_FILE, required=required, help=help_text)


def signing_key(path: Path) -> SigningKey:
    """The key `--sign-key` names, its passphrase from COSIGN_PASSWORD (as cosign takes it):
    the one place the variable is read."""
    from sm121_build.image.cosign import SigningKey

    return SigningKey.load(path, os.environ.get("COSIGN_PASSWORD"))


def trust_key_option(help_text: str, required: bool = False) -> Callable[[F], F]:
    """`--trust-key KEY` (default: $SM121_TRUST_KEY), the same option on every command that
    takes prebuilt kernels; `help_text` says what it refuses there."""
    return click.option("--trust-key", type=KEY_FILE, envvar="SM121_TRUST_KEY",
                        required=required,
                        help=help_text + ("" if required else "  Default: $SM121_TRUST_KEY."))


def arch_option(help_text: str) -> Callable[[F], F]:
    """`--arch LIST` (default 12.1): a source build's TORCH_CUDA_ARCH_LIST, parsed into an
    `ArchList` by `arch_list`; the same option on each command that compiles from source."""
    return click.option("--arch", default=DEFAULT_ARCH, show_default=True, callback=arch_list,
                        help=help_text)


def extension_option(help_text: str) -> Callable[[F], F]:
    """`--ext NAME` (repeatable): another extension to build, checked by `extension_names`."""
    return click.option("--ext", "extra_ext", multiple=True, callback=extension_names,
                        help=help_text)


def jobs_option() -> Callable[[F], F]:
    """`--jobs N`: MAX_JOBS of a source build (1 to 4096 ASCII digits)."""
    return click.option("--jobs", type=JOBS, help="MAX_JOBS (default: from cores and memory).")
