"""The exception types the CLI turns into one `error: …` line and an exit code per class.

| exit | class                 | when                                                         |
|------|-----------------------|--------------------------------------------------------------|
| 1    | RequirementNotMet     | `audit --require` found kernels below the floor, or nothing  |
| 2    | Sm121Error            | bad input: a reference, tag, path, arch, name, file, source  |
| 3    | VerificationError     | a built image failed verification (nothing was tagged)       |
| 4    | EngineUnavailable     | the Docker engine cannot be reached or lost the connection   |
| 5    | BuildFailed           | the compile (docker build or `local`) failed                 |
| 6    | PatchDrift            | a guard rule cannot be applied to this source                |
| 7    | RegistryUnavailable   | a registry did not answer in time, or refused the request    |
| 130  | (KeyboardInterrupt)   | Ctrl-C / SIGTERM: temporary files and containers removed     |
"""

from __future__ import annotations

INTERRUPTED = 130


class Sm121Error(Exception):
    """A user-facing failure: the message is one actionable line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class CorruptBinaryError(Sm121Error):
    """An ELF or fatbin that cannot be read as such."""


class RequirementNotMet(Sm121Error):
    """`audit --require`: a kernel would not load as required (a check result, like grep's)."""

    exit_code = 1


class VerificationError(Sm121Error):
    """A built image failed a verification check."""

    exit_code = 3


class EngineUnavailable(Sm121Error):
    """The Docker engine is not reachable."""

    exit_code = 4


class DockerConfigRefused(EngineUnavailable):
    """Docker's config.json, which the Docker SDK reads itself to reach the engine, is not a
    bounded regular file of the shape the SDK reads: the engine cannot be asked (exit 4)."""

    fix = ("make it a regular JSON object of at most 1 MiB, remove it, or set DOCKER_CONFIG "
           "to a folder with one")

    def __init__(self, detail: str) -> None:
        super().__init__(f"{detail}: {self.fix}")
        self.detail = " ".join(detail.split())


class BuildFailed(Sm121Error):
    """The compile failed; the log file says why."""

    exit_code = 5


class PatchDrift(Sm121Error):
    """A guard rule cannot be applied: the source moved past what the rule understands."""

    exit_code = 6


class EngineRefused(Sm121Error):
    """The engine answered and said no (an image it cannot inspect, tag, build from, push):
    the request's fault or the engine's state, not a lost connection (exit 2)."""


class ToolchainError(Sm121Error):
    """A tool the work needs is missing, too old, or failed: ptxas/fatbinary, cmake, an
    image without a compiler (exit 2)."""


class ManifestUnknown(Sm121Error):
    """The registry answered that it has no such tag or manifest (a miss, not a failure)."""


class RegistryUnavailable(Sm121Error):
    """A registry could not be asked: it gave no answer within the limit, is down, or
    refused the login (not the image's fault)."""

    exit_code = 7


class NoGpu(Sm121Error):
    """`prove`: no GPU to run on (libcuda.so.1 missing, cuInit failed, no device) (exit 2)."""


class WrongGpu(Sm121Error):
    """`prove`: the files' added cubins are for another GPU than this machine's (exit 2)."""


class HarnessMismatch(Sm121Error):
    """`prove`: a library's ops are not those a harness calls (an op or an argument name
    missing) (exit 2)."""


EXIT_CODES: dict[str, int] = {cls.__name__: cls.exit_code for cls in (
    RequirementNotMet, Sm121Error, VerificationError, EngineUnavailable, BuildFailed,
    PatchDrift, RegistryUnavailable)}
