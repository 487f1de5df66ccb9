"""Mutation score of the core modules against the unit tests (mutmut, from PyPI).

    pip install -e '.[test,mutation]'
    python benchmarks/mutation.py                      # every core module (tens of minutes)
    python benchmarks/mutation.py sm121_build/cuda/compat.py --tests tests/unit/test_compat.py
    python benchmarks/mutation.py sm121_build/jobs/main_run/main_job.py --only content_key \
        --tests tests/unit/test_content_key.py

Each module is mutated in a scratch copy of the repository (nothing here is touched); the
unit tests run against every mutant (mutmut runs only the tests that reach the mutated
function).  Prints per module: mutants killed, survived, not reached by any test, timed out,
and the score killed / (all - not reached); then the surviving mutants by name (read one
with `mutmut show NAME` in the scratch copy, whose path is printed).  Not part of CI.

    python benchmarks/mutation.py --promises        # the hand-written promise mutants (CI)
    python benchmarks/mutation.py --promises --mutant 'registry, deadline'  # those named

`--promises` applies each mutant of benchmarks/promise_mutants.yaml alone (a plausible
change that breaks one promise of the verification or tagging, which mutmut's token
operators cannot make) to a scratch copy of its own and runs the suite named there in one
process, `--jobs` mutants at once (the CPU count); it exits 1 when one survives.  A mutant
whose text is not found exactly once is an error (the file moved on).
`--mutant TEXT` (repeatable) runs only the mutants whose promise holds TEXT, and the
baseline of their suites only.  `--after-suite`: the whole test suite has just passed on
this tree (`.ci/run` runs it first, and stops on a failure), so the baseline, a subset of
it, is not run again.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Each core module and the unit tests that exercise it (the README's scores were measured so;
# the whole of tests/unit cannot be the default: test_packaging needs a git checkout).
U = "tests/unit/"
SUITES: dict[str, list[str]] = {
    "sm121_build/cuda/fatbin.py": [f"{U}test_fatbin_layout.py", f"{U}test_fatbin_vs_cuobjdump.py",
                                     f"{U}test_audit_tus.py", f"{U}test_verify_checks.py",
                                     f"{U}test_bad_input.py", f"{U}test_verify_promises.py",
                                     f"{U}test_raw_device_files.py"],
    "sm121_build/cuda/compat.py": [f"{U}test_compat.py"],
    "sm121_build/cuda/binary.py": [f"{U}test_decide.py", f"{U}test_audit_counts.py",
                                    f"{U}test_audit_tus.py", f"{U}test_cli_audit.py"],
    "sm121_build/rebuild/decide.py": [f"{U}test_decide.py", f"{U}test_audit_counts.py",
                                      f"{U}test_audit_tus.py", f"{U}test_cli_audit.py"],
    "sm121_build/verify/checks.py": [f"{U}test_verify_checks.py", f"{U}test_pipeline.py",
                                     f"{U}test_verify_promises.py"],
    "sm121_build/jobs/upkeep/pruning.py": [f"{U}test_tag_safety.py"],
    "sm121_build/image/refs.py": [f"{U}test_refs.py"],
    "sm121_build/jobs/main_run/main_job.py": [f"{U}test_content_key.py"],  # with --only content_key
    "sm121_build/source/guard_rules.py": [f"{U}test_patch.py", f"{U}test_guard_rules.py",
                                    f"{U}test_flash_attn_rule.py"],
    "sm121_build/source/guards.py": [f"{U}test_guards.py", f"{U}test_guard_rules.py",
                                     f"{U}test_flash_attn_rule.py", f"{U}test_cmake_lang.py"],
}
CORE = tuple(SUITES)
COPIED = ("sm121_build", "tests", "devkit", "patches", "dockerfiles", "benchmarks", ".ci",
          "docs", "README.md", "pyproject.toml")
RESULT = re.compile(r"^\s*(?P<name>\S+): (?P<status>[a-z ]+)$")


def scratch_copy(prefix: str) -> Path:
    """A copy of what the tests need, where a mutant can be applied."""
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns(
                "__pycache__", ".mypy_cache"))
        else:
            shutil.copy2(source, scratch / name)
    return scratch


def score(module: str, tests: list[str], keep: bool, only: str | None = None,
          seconds: float | None = None) -> tuple[Counter[str], list[str], Path]:
    scratch = scratch_copy("mutation-sm121-")
    (scratch / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths={module}\n"
        "also_copy=\n" + "".join(f"    {n}\n" for n in COPIED[:-1]) +
        "pytest_add_cli_args_test_selection=\n" + "".join(f"    {t}\n" for t in tests))
    env = {**os.environ, "SM121_TEST_CACHE": str(ROOT / ".cache")}
    mutmut = str(Path(sys.executable).parent / "mutmut")
    dotted = module.removesuffix(".py").replace("/", ".")
    names = [f"{dotted}.x_{only}__mutmut_*"] if only else []
    process = subprocess.Popen([mutmut, "run", *names], cwd=scratch, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:  # stop it and its workers; finished mutants keep results
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
    listed = subprocess.run([mutmut, "results", "--all", "true"], cwd=scratch, env=env,
                            capture_output=True, text=True, check=False).stdout
    counts: Counter[str] = Counter()
    survivors = []
    for line in listed.splitlines():
        match = RESULT.match(line)
        if match and (not only or f".x_{only}__mutmut_" in match.group("name")):
            # a mutant that crashes the test process (a bad pointer into the C++ runtime)
            # is caught as surely as a failed assertion
            status = match.group("status")
            counts["killed" if status == "segfault" else status] += 1
            if match.group("status") == "survived":
                survivors.append(match.group("name"))
    if not keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return counts, survivors, scratch


@dataclass(frozen=True)
class MutantRun:
    """How one promise mutant ended: its promise, killed or not, the line to print, or why
    it could not be applied (`broken`)."""

    promise: str
    killed: bool = False
    line: str = ""
    broken: str = ""


def _one_mutant(number: int, mutant: dict[str, Any], suite: list[str], env: dict[str, str],
                keep: bool) -> MutantRun:
    """Mutant `number` applied alone to a scratch copy of its own, its suite run there
    (one process: `-n 0`; the mutants themselves run side by side)."""
    promise = str(mutant["promise"])
    scratch = scratch_copy("promise-sm121-")
    try:
        target = scratch / mutant["file"]
        text = target.read_text()
        if text.count(mutant["find"]) != 1:
            return MutantRun(promise, broken=f"{promise}: {mutant['find']!r} occurs "
                             f"{text.count(mutant['find'])} times in {mutant['file']}")
        target.write_text(text.replace(mutant["find"], mutant["replace"]))
        started = time.monotonic()
        tests = [str(t) for t in mutant.get("suite", suite)]
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p",
                              "no:cacheprovider", *tests], cwd=scratch, env=env,
                             capture_output=True, text=True, check=False)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    killed = run.returncode not in (0, 5)
    failed = next((line for line in run.stdout.splitlines() if line.startswith("FAILED")), "")
    line = (f"{number:>3} {'killed' if killed else 'SURVIVED':<9} "
            f"{time.monotonic() - started:5.1f}s  {promise}"
            + (f"\n              by {failed.split(' - ')[0].removeprefix('FAILED ')}"
               if failed else ""))
    return MutantRun(promise, killed, line)


def promise_mutants(keep: bool = False, chosen: list[str] | None = None,
                    baseline_run: bool = True, jobs: int = 1) -> int:
    """Every hand-written mutant (or those whose promise holds one of `chosen`) must be
    killed; returns the exit code.  `baseline_run`: first the suites on the tree as it is
    (False: the caller ran the whole suite, which holds them, and it passed)."""
    import yaml

    spec = yaml.safe_load((ROOT / "benchmarks" / "promise_mutants.yaml").read_text())
    suite = [str(t) for t in spec["suite"]]
    mutants = [(number, m) for number, m in enumerate(spec["mutants"], 1)
               if not chosen or any(c in m["promise"] for c in chosen)]
    if not mutants:
        print(f"error: no mutant's promise holds {chosen}", file=sys.stderr)
        return 2
    # a mutant may name the tests that hold its promise (`suite:`), the rest run the common one
    every = list(dict.fromkeys(str(t) for _n, m in mutants for t in m.get("suite", suite)))
    env = {**os.environ, "SM121_TEST_CACHE": str(ROOT / ".cache")}
    survivors, broken = [], []
    baseline = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *every], cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False) if baseline_run else None
    # a mutant "killed" by a test that fails anyway proves nothing
    if baseline is not None and baseline.returncode != 0:
        print(baseline.stdout[-2000:], file=sys.stderr)
        print("error: the promise suite fails without any mutant", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max(1, min(jobs, len(mutants)))) as pool:
        ran = [pool.submit(_one_mutant, number, mutant, suite, env, keep)
               for number, mutant in mutants]
        for future in ran:  # in the file's order, each printed once it has ended
            outcome = future.result()
            if outcome.broken:
                broken.append(outcome.broken)
                continue
            print(outcome.line, flush=True)
            if not outcome.killed:
                survivors.append(outcome.promise)
    total = len(mutants)
    print(f"promise mutants: {total - len(survivors) - len(broken)} of {total} killed")
    for line in broken:
        print(f"error: mutant cannot be applied: {line}", file=sys.stderr)
    for promise in survivors:
        print(f"error: survived: {promise}", file=sys.stderr)
    return 1 if survivors or broken else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(CORE))
    parser.add_argument("--tests", nargs="+",
                        help="Test files to run against each mutant (default: the module's "
                             "suite in SUITES).")
    parser.add_argument("--keep", action="store_true", help="Keep the scratch copies.")
    parser.add_argument("--seconds", type=float,
                        help="Stop mutmut after this long; the score covers the mutants run "
                             "(the rest count as `not checked`).")
    parser.add_argument("--only", metavar="FUNCTION",
                        help="Mutate one module-level function only (e.g. content_key).")
    parser.add_argument("--promises", action="store_true",
                        help="Run the hand-written promise mutants instead (no mutmut).")
    parser.add_argument("--after-suite", action="store_true",
                        help="With --promises: the whole suite has just passed on this tree; "
                             "no baseline run.")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="With --promises: how many mutants run at once, each in its own "
                             "scratch copy (default: the CPU count).")
    parser.add_argument("--mutant", action="append", metavar="TEXT",
                        help="With --promises: only the mutants whose promise holds TEXT "
                             "(repeatable).")
    args = parser.parse_args()
    if args.promises:
        return promise_mutants(args.keep, args.mutant, not args.after_suite, args.jobs)
    if shutil.which("mutmut", path=str(Path(sys.executable).parent)) is None:
        print("error: mutmut not installed: pip install -e '.[test,mutation]'", file=sys.stderr)
        return 2
    print(f"{'module':<28} {'killed':>7} {'survived':>9} {'no tests':>9} {'timeout':>8} "
          f"{'score':>7}")
    for module in args.modules:
        tests = args.tests or SUITES.get(module, ["tests/unit"])
        counts, survivors, scratch = score(module, tests, args.keep, args.only, args.seconds)
        reached = sum(counts.values()) - counts["no tests"] - counts["not checked"]
        ratio = f"{counts['killed'] / reached:.1%}" if reached else "-"
        print(f"{module:<28} {counts['killed']:>7} {counts['survived']:>9} "
              f"{counts['no tests']:>9} {counts['timeout']:>8} {ratio:>7}")
        for name in survivors:
            print(f"    survived: {name}")
        if args.keep:
            print(f"    scratch copy: {scratch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
