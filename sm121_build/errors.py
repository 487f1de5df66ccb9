"""The one exception type the CLI turns into a one-line error and a non-zero exit."""

from __future__ import annotations


class Sm121Error(Exception):
    """A user-facing failure: the message is one actionable line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class CorruptBinaryError(Sm121Error):
    """An ELF or fatbin that cannot be read as such."""


class VerificationError(Sm121Error):
    """A built image failed a verification check."""

    exit_code = 3
