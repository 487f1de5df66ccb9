"""The console script's entry (`sm121-build`, `python -m sm121_build`): Ctrl-C and SIGTERM are
held before anything else of the tool is imported, so one that lands while click and the
command load waits for the command's handler (`cli.main`) instead of ending in a traceback."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def main() -> None:
    from sm121_build.cli import main as run_command

    run_command()
