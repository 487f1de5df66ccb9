"""`sm121-build doctor`: is this machine ready for a run?  One line per check, the fix
beside each WARN/FAIL, exit 0 / 1 / 2 for the worst (OK / WARN / FAIL)."""

from __future__ import annotations

import sys

import click

from sm121_build.core.console import results_to_stderr, say, say_json, shown
from sm121_build.image.refs import validate_image_ref
from sm121_build.jobs.upkeep.doctor_checks import RANK, Probe, docker_engine, run_checks, worst


@click.command()
@click.option("--registry", "refs", multiple=True, metavar="REF",
              help="An image or repository you will pull from or push to: is there a login "
                   "for its registry? (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="The checks as JSON on stdout.")
def doctor(refs: tuple[str, ...], as_json: bool) -> None:
    """Check the engine, BuildKit, disk, tools, GPU, logins and paths, each with its fix."""
    if as_json:
        results_to_stderr()  # stdout holds the JSON alone (an annotation goes to stderr)
    for ref in refs:
        validate_image_ref(ref)  # before any probe
    checks = run_checks(Probe(engine=docker_engine), refs)
    bad = worst(checks)
    if as_json:
        say_json({"checks": [c.as_json() for c in checks], "worst": bad})
    else:
        width = max(len(c.name) for c in checks)
        for check in checks:
            say(f"{check.status:<4} {check.name:<{width}}  {shown(check.detail)}")
            if check.fix:
                say(f"     {'':<{width}}  fix: {shown(check.fix)}")
        say(f"worst: {bad}")
    sys.exit(RANK[bad])
