"""The console script's entry (`sm121-build`, `python -m sm121_build`): Ctrl-C and SIGTERM are
held before anything else of the tool is imported, so one that lands while click and the
command load waits for the command's handler (`cli.main`) instead of ending in a traceback.
`_signal`, the interpreter's own built-in module, holds them: `signal` would first import
`enum`, a window of its own.  What remains is the interpreter's start, before any of the
tool's code runs."""

import _signal  # type: ignore[import-not-found]  # (typeshed has no stub of it)

_signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})


def main() -> None:
    from sm121_build.cli import main as run_command

    run_command()
