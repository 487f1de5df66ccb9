"""Mutation score of the core modules against the unit tests (mutmut, from PyPI).

    pip install -e '.[test,mutation]'
    python benchmarks/mutation.py                      # every core module (tens of minutes)
    python benchmarks/mutation.py sm121_build/verify/compat.py --tests tests/unit/test_compat.py
    python benchmarks/mutation.py sm121_build/build/main_job.py --only content_key \
        --tests tests/unit/test_content_key.py

Each module is mutated in a scratch copy of the repository (nothing here is touched); the
unit tests run against every mutant (mutmut runs only the tests that reach the mutated
function).  Prints per module: mutants killed, survived, not reached by any test, timed out,
and the score killed / (all - not reached); then the surviving mutants by name (read one
with `mutmut show NAME` in the scratch copy, whose path is printed).  Not part of CI.
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
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each core module and the unit tests that exercise it (the README's scores were measured so;
# the whole of tests/unit cannot be the default: test_packaging needs a git checkout).
U = "tests/unit/"
SUITES: dict[str, list[str]] = {
    "sm121_build/verify/fatbin.py": [f"{U}test_fatbin_layout.py", f"{U}test_fatbin_vs_cuobjdump.py",
                                     f"{U}test_audit_tus.py", f"{U}test_verify_checks.py",
                                     f"{U}test_bad_input.py"],
    "sm121_build/verify/compat.py": [f"{U}test_compat.py"],
    "sm121_build/verify/audit.py": [f"{U}test_fixable.py", f"{U}test_audit_counts.py",
                                    f"{U}test_audit_tus.py", f"{U}test_cli_audit.py"],
    "sm121_build/verify/fixable.py": [f"{U}test_fixable.py", f"{U}test_audit_counts.py",
                                      f"{U}test_audit_tus.py", f"{U}test_cli_audit.py"],
    "sm121_build/verify/checks.py": [f"{U}test_verify_checks.py", f"{U}test_pipeline.py"],
    "sm121_build/image/refs.py": [f"{U}test_refs.py"],
    "sm121_build/build/main_job.py": [f"{U}test_content_key.py"],  # with --only content_key
    "sm121_build/source/patch.py": [f"{U}test_patch.py", f"{U}test_guard_rules.py",
                                    f"{U}test_flash_attn_rule.py"],
    "sm121_build/source/guards.py": [f"{U}test_guards.py", f"{U}test_guard_rules.py",
                                     f"{U}test_flash_attn_rule.py", f"{U}test_cmake_lang.py"],
}
CORE = tuple(SUITES)
COPIED = ("sm121_build", "tests", "devkit", "patches", "dockerfiles", "benchmarks", "README.md",
          "pyproject.toml")
RESULT = re.compile(r"^\s*(?P<name>\S+): (?P<status>[a-z ]+)$")


def score(module: str, tests: list[str], keep: bool, only: str | None = None,
          seconds: float | None = None) -> tuple[Counter[str], list[str], Path]:
    scratch = Path(tempfile.mkdtemp(prefix="mutation-sm121-"))
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns(
                "__pycache__", ".mypy_cache"))
        else:
            shutil.copy2(source, scratch / name)
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
    args = parser.parse_args()
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
