"""The `sm121-build` command: a click group; one module per subcommand, options in inputs."""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import click

from sm121_build import __version__
from sm121_build.errors import INTERRUPTED, Sm121Error
from sm121_build.steps import notice, report_error


class _Group(click.Group):
    """`sm121-build --base IMAGE ...` is short for `sm121-build build --base IMAGE ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0].startswith("--base"):
            args = ["build", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Sm121Error as exc:
            report_error(str(exc))
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            notice("interrupted: temporary files and containers were removed")
            sys.exit(INTERRUPTED)
        except OSError as exc:
            # the file system said no (permissions, a full disk, a loop of links): one line
            where = f"{exc.filename}: " if exc.filename else ""
            report_error(f"{where}{exc.strerror or exc}")
            sys.exit(Sm121Error.exit_code)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="sm121-build")
def cli() -> None:
    """Native sm_121 (DGX Spark, GB10) kernels for stock vLLM images.

    The main job: sm121-build --base vllm/vllm-openai:nightly --pull
    """


def _register() -> None:
    from sm121_build.cli.audit import audit
    from sm121_build.cli.build import build
    from sm121_build.cli.dockerfile import dockerfile
    from sm121_build.cli.inject import inject
    from sm121_build.cli.patch import patch
    from sm121_build.cli.pin import pin
    from sm121_build.cli.prune import prune_command

    for command in (build, inject, audit, pin, patch, dockerfile, prune_command):
        cli.add_command(command)


_register()


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # Ctrl-C and a CI runner's cancel (SIGINT, then SIGTERM) both clean up and exit 130, also
    # when a shell started this in the background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = cli.main(prog_name="sm121-build", standalone_mode=False)
    except click.UsageError as exc:
        # click would print usage and a hint over several lines: one `error:` line instead
        where = exc.ctx.command_path if exc.ctx else "sm121-build"
        message = " ".join(exc.format_message().split())
        report_error(f"{message} (see {where} --help)")
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        report_error(" ".join(exc.format_message().split()))
        sys.exit(exc.exit_code)
    except click.Abort:
        notice("interrupted")
        sys.exit(INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)
