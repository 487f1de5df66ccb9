"""The `sm121-build` command: a click group; one module per subcommand, options in params."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import click

from sm121_build.core.children import adopt_orphans, end_all
from sm121_build.core.console import notice, report_error, set_progress, set_verbosity
from sm121_build.core.errors import INTERRUPTED, EngineUnavailable, Sm121Error
from sm121_build.core.interrupts import (
    held,
    hold_from_start,
    install,
    quiet,
    release,
    signalled,
)

if TYPE_CHECKING:
    from sm121_build.image.api import ImageEngine
    from sm121_build.source.cmake_run import CMakeOutput, CMakeRunner, CMakeScript

SIGPIPE_STATUS = 128 + signal.SIGPIPE


def _connect() -> ImageEngine:
    from sm121_build.image.engine import Engine

    return Engine.connect()


class _Confined:
    """The runner every command evaluates a source tree's CMake with: a throwaway container
    (`jobs/framework/cmake_sandbox.py`), made when a tree is first evaluated, so a command that
    evaluates none loads no job module and asks no engine."""

    def __init__(self) -> None:
        self.runner: CMakeRunner | None = None

    def run(self, script: CMakeScript) -> CMakeOutput:
        if self.runner is None:
            from sm121_build.jobs.framework.cmake_sandbox import source_runner

            self.runner = source_runner(_connect)
        return self.runner.run(script)


@contextlib.contextmanager
def _tree_code_confined() -> Iterator[None]:
    from sm121_build.source.cmake_run import evaluating_with

    with evaluating_with(_Confined()):
        yield  # 141, as `yes | head -1` leaves `yes`


class _Group(click.Group):
    """`sm121-build --base IMAGE ...` is short for `sm121-build build --base IMAGE ...`;
    commands are imported when used (`COMMANDS`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name]
        # a module half imported cannot be cut by a signal: one that lands inside a class
        # statement comes out of it as another error (a RuntimeError from `__set_name__`)
        with held():
            loaded = importlib.import_module(module)
        command = getattr(loaded, attribute)
        assert isinstance(command, click.Command)
        return command

    def resolve_command(self, ctx: click.Context, args: list[str]
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        """The command and its arguments, none of them empty (checked before any work)."""
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            refuse_empty(click.Context(command, info_name=name, parent=ctx), rest)
        return name, command, rest

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        lead = 0
        while lead < len(args) and (args[lead] in ("-q", "--quiet", "-v", "--verbose")
                                     or args[lead].startswith("--progress")):
            lead += 1 + (args[lead] == "--progress")
        refuse_empty(ctx, args[:lead])  # the group's own options (`--progress " "`) too
        if lead < len(args) and args[lead].startswith("--base"):
            args = [*args[:lead], "build", *args[lead:]]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            release()  # Ctrl-C and SIGTERM from here on: handled below
            check_environment()  # every command refuses a bad SM121_* value alike
            return _ended(lambda: super(_Group, self).invoke(ctx))
        except Sm121Error as exc:
            quiet()  # the command has ended: a signal now cannot add a second line
            report_error(str(exc) + (left_behind() if isinstance(exc, EngineUnavailable)
                                     else ""))
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            interrupted()
        except BrokenPipeError:
            closed_pipe()
        except OSError as exc:
            quiet()
            answered = _engine_answer(exc)
            if answered:  # the engine is there and said no (a 404, a 500): not a lost link
                report_error(answered + left_behind())
                sys.exit(Sm121Error.exit_code)
            if _engine_connection(exc):
                report_error(engine_lost_line(exc))
                sys.exit(EngineUnavailable.exit_code)
            # the file system said no (permissions, a full disk, a loop of links): one line
            where = f"{exc.filename}: " if exc.filename else ""
            report_error(f"{where}{exc.strerror or exc}")
            sys.exit(Sm121Error.exit_code)
        except Exception:
            # after the run's signal, whatever broke broke because of it (Python turns an
            # interrupt inside some steps into another error): the interrupt's one end
            if signalled():
                interrupted()
            raise


def _ended(command: Callable[[], Any]) -> Any:
    """The command run, then `quiet`: once it has returned or exited with its own status
    (doctor's rank) a signal cannot reach click's `main`, which would print a blank line
    before the interrupt's (its closing of a terminal's `^C` echo).  One that lands before
    `quiet` is raised here, in the command's handler (`_Group.invoke`)."""
    try:
        with _tree_code_confined():
            result = command()
    except SystemExit:
        quiet()
        raise
    quiet()
    return result


def interrupted_line() -> str:
    """What an interrupt left: nothing (the programs the run started were killed, its
    temporary files and containers removed), or what could not be removed."""
    from sm121_build.core.leftovers import LEFT_BEHIND

    if not LEFT_BEHIND:
        return "interrupted: the programs it started were ended, its temporary files and " \
            "containers removed"
    return f"interrupted{left_behind()}"


def check_environment() -> None:
    """The tool's SM121_* variables, checked before any work by one rule on every command:
    a time limit by `core/limits`; `SM121_CMAKE_ON_HOST` 1, 0 or unset; no value of
    whitespace alone or with a control character (a variable that stands for an option,
    `SM121_BUILD_REPO`, `SM121_TRUST_KEY`, is refused as the option would refuse it)."""
    from sm121_build.core.errors import Sm121Error
    from sm121_build.core.limits import Limits
    from sm121_build.source.cmake_run import ON_HOST_VARIABLE

    for name, value in sorted(os.environ.items()):
        if not name.startswith("SM121_"):
            continue
        if value and (not value.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F
                                                 for c in value)):
            raise Sm121Error(f"{name}={value!r}: whitespace alone or a control character; "
                             "unset it, or give a value")
    if os.environ.get(ON_HOST_VARIABLE, "").strip() not in ("", "0", "1"):
        raise Sm121Error(f"{ON_HOST_VARIABLE}={os.environ[ON_HOST_VARIABLE]!r}: expected 1 "
                         "(run a tree's CMake on this host) or 0")
    Limits.from_environment()


def refuse_empty(ctx: click.Context, args: list[str]) -> None:
    """An empty value (`--gpu ""`, `--out=`, `--out " "`, an empty argument; whitespace
    alone is empty) is refused the same way on every command, before any value is read:
    never taken as the default, the current folder, a file named " " or "not given"."""
    for at, arg in enumerate(args):
        option, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", "")
        if arg.strip() != "" and not (equals and value.strip() == ""):
            continue
        after = option or (args[at - 1] if at and args[at - 1].startswith("-") else "")
        raise click.UsageError(f"an empty value for {after}: give a value, or leave the "
                               "option out for its default" if after else
                               "an empty argument: give a value", ctx)


def interrupted() -> NoReturn:
    """The one end of an interrupted run, its cleanup done: the line, then exit 130 at once.
    Not through SystemExit: a KeyboardInterrupt that once passed through code `exec` ran
    from a string (a dataclass's or namedtuple's methods being made) leaves CPython's flag
    of an unhandled interrupt set, caught or not, and the interpreter would then end the
    process by SIGINT instead of with 130; nothing is left for its finalization to do."""
    notice(interrupted_line())
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(INTERRUPTED)


def closed_pipe() -> NoReturn:
    """The reader of our output went away (`sm121-build audit … | head -1`): end quietly with
    the status a shell gives a command SIGPIPE ended, and let no later flush complain."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    quiet()
    sys.exit(SIGPIPE_STATUS)


def _engine_answer(exc: BaseException) -> str:
    """What the engine answered, for an error the engine sent (the Docker SDK's APIError: an
    HTTP status and the engine's own words); "" for any other error."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if type(exc).__module__.split(".")[0] != "docker" or not isinstance(status, int):
        return ""
    said = " ".join(str(getattr(exc, "explanation", None) or exc).split())[:200]
    return f"the Docker engine answered {status}: {said}"


def _engine_connection(exc: BaseException) -> bool:
    """An error of the connection to the engine (the Docker SDK's requests/urllib3 stack)."""
    return type(exc).__module__.split(".")[0] in ("requests", "urllib3", "docker")


def left_behind() -> str:
    """What this run made in the engine and could not remove (the engine went away)."""
    from sm121_build.core.leftovers import left_behind_line

    return left_behind_line()


def engine_lost_line(exc: BaseException) -> str:
    """The engine went away mid-run: what was said, and what this run may have left there."""
    said = " ".join(str(exc).split())[:160]
    return f"lost the connection to the Docker engine ({type(exc).__name__}: {said})" + \
        left_behind()


@click.group(cls=_Group)
@click.version_option(package_name="sm121-build", prog_name="sm121-build")
@click.option("-q", "--quiet", "quiet", count=True,
              help="Only steps, results and errors (no detail lines, no live line).")
@click.option("-v", "--verbose", "verbose", count=True,
              help="Also every line of the build's own output (as it goes to the log).")
@click.option("--progress", type=click.Choice(["auto", "plain", "quiet"]), default="auto",
              show_default=True, help="Live lines rewritten in place on a terminal (auto), "
              "plain lines every so often (plain, as on CI), or none (quiet).")
def cli(quiet: int, verbose: int, progress: str) -> None:
    """Native sm_121 (DGX Spark, GB10) kernels for stock vLLM images.

    The main job: sm121-build --base vllm/vllm-openai:nightly --pull

    Shell completion (click's): eval "$(_SM121_BUILD_COMPLETE=bash_source sm121-build)"
    (zsh_source, fish_source for the other shells).  Output carries no colour codes.
    """
    if quiet and verbose:
        raise click.UsageError("-q and -v together: choose one")
    set_verbosity(0 if quiet else 2 if verbose else 1)
    set_progress(progress)


# name -> (module, attribute): a command's module (and what it imports: the engine, git, the
# renderer) is loaded only when that command runs, so `audit FILE` loads no Docker code.
COMMANDS = {
    "build": ("sm121_build.cli.build", "build"),
    "local": ("sm121_build.cli.local", "local"),
    "inject": ("sm121_build.cli.inject", "inject"),
    "audit": ("sm121_build.cli.audit", "audit"),
    "aot": ("sm121_build.cli.aot", "aot"),
    "pin": ("sm121_build.cli.pin", "pin"),
    "patch": ("sm121_build.cli.patch", "patch"),
    "dockerfile": ("sm121_build.cli.dockerfile", "dockerfile"),
    "prune": ("sm121_build.cli.prune", "prune_command"),
    "doctor": ("sm121_build.cli.doctor", "doctor"),
    "kernels": ("sm121_build.cli.kernels", "kernels"),
    "prove": ("sm121_build.cli.prove", "prove"),
}


def main() -> None:
    # Ctrl-C and a CI runner's cancel (SIGINT, then SIGTERM) both clean up and exit 130, also
    # when a shell started this in the background with SIGINT ignored.
    # Held until the command's own handler (`_Group.invoke`) is in place: a signal that
    # lands before it would end in a traceback.  Python's first look for its temp folder
    # (a probe file written and removed) happens in that window too, not cut in two.
    hold_from_start()
    # the first Ctrl-C or SIGTERM stops the work: every program the run started is killed
    # with its group at once (a ptxas an hour from its limit too), then the cleanup runs
    # (temporary files, containers, the image a run made), never cut short by another
    install(end_all)
    adopt_orphans()  # a program's grandchild that leaves its group is still ended with it
    tempfile.gettempdir()
    try:
        code = _run_command()
        quiet()  # ended: a signal from here on cannot turn its exit into a death by signal
    except KeyboardInterrupt:  # the signal landed as the command's end was under way
        interrupted()
    sys.exit(code)


def _run_command() -> int:
    """The command's exit status, its errors reported; an interrupt ends here (130).  Every
    end comes back as a status, so the exit is made by `main` after `quiet`: a signal in the
    unwinding of a `SystemExit` would otherwise end in a traceback."""
    try:
        code = cli.main(prog_name="sm121-build", standalone_mode=False)
        sys.stdout.flush()
    except SystemExit as exc:  # a command's own exit: an error reported, doctor's rank
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        raise
    except BrokenPipeError:
        closed_pipe()
    except click.UsageError as exc:
        quiet()  # the command has ended: a signal now cannot add a second line
        # click would print usage and a hint over several lines: one `error:` line instead
        where = exc.ctx.command_path if exc.ctx else "sm121-build"
        message = " ".join(exc.format_message().split())
        report_error(f"{message} (see {where} --help)")
        return exc.exit_code
    except click.ClickException as exc:
        quiet()
        report_error(" ".join(exc.format_message().split()))
        return exc.exit_code
    except (click.Abort, KeyboardInterrupt):  # (after the command's own handler let go)
        interrupted()
    return code if isinstance(code, int) else 0
