"""Pin vLLM source to the exact commit an image was built from, and fetch it.

Version to git ref:
- `__commit_id__` from `_version.py` when present (setuptools-scm writes `g<hash>`);
- a dev or local build carrying `+g<hash>` (e.g. `0.19.2rc1.dev154+g1c2c1eb8b.d20260101`)
  pins that commit;
- a release (`0.17.0`, also `0.17.0+cu130`) pins the tag `v0.17.0`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from sm121_build.core.children import Program, run
from sm121_build.core.console import notice
from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import InputRefused, read_input
from sm121_build.core.paths import cache_dir
from sm121_build.source.external import ProjectPin, require_project_tree
from sm121_build.source.tree import require_contained

UPSTREAM = "https://github.com/vllm-project/vllm.git"
_HASH = re.compile(r"^g?([0-9a-f]{7,40})$")
_LOCAL_HASH = re.compile(r"(?:^|\.)g([0-9a-f]{7,40})(?:\.|$)")


@dataclass(frozen=True)
class GitRef:
    kind: str  # "tag" or "commit"
    value: str

    def __str__(self) -> str:
        return f"{self.kind} {self.value}"

MAX_UNTRACKED = 1 << 30  # an untracked file hashed into the source's identity


def version_to_ref(version: str, commit_id: str | None = None) -> GitRef:
    if commit_id:
        match = _HASH.match(commit_id.strip())
        if match:
            return GitRef("commit", match.group(1))
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise Sm121Error(f"cannot map vLLM version {version!r} to a git ref: "
                         "not a PEP 440 version; pass --source DIR with a checkout") from None
    if parsed.local:
        match = _LOCAL_HASH.search(parsed.local)
        if match:
            return GitRef("commit", match.group(1))
    if parsed.is_devrelease:
        raise Sm121Error(f"cannot map vLLM version {version!r} to a git ref: a dev build with "
                         "no +g<commit> label; pass --source DIR with a checkout")
    return GitRef("tag", f"v{parsed.public}")


# What a tree's own git config could make `git` run (a hostile tree handed over with its
# `.git/`): hooks, the file-system monitor, an external diff, textconv; all turned off.
_SAFE_GIT = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
             "-c", "diff.external=")
GIT_TIMEOUT_S = 1800.0  # a fetch of vLLM (and its submodules) over a slow link
LOCAL_GIT_TIMEOUT_S = 300.0  # a call on a tree already here (a diff of vLLM: seconds)


MAX_GIT_OUTPUT = 64 << 20  # what git may print that the tool reads whole (a name list)


@dataclass(frozen=True)
class GitResult:
    """How one git call ended: its status, its stdout whole, and what it said on stderr."""

    returncode: int
    stdout: str
    stderr: str


def _git(*args: str, cwd: Path | None = None,
         sink: Callable[[bytes], None] | None = None,
         seconds: float | None = None) -> GitResult:
    """git with the tree's own hooks and helpers off, in its own process group, within
    `seconds` (LOCAL_GIT_TIMEOUT_S when not given, GIT_TIMEOUT_S for what crosses the
    network); its stdout whole (at most MAX_GIT_OUTPUT), or each chunk to `sink`."""
    limit = LOCAL_GIT_TIMEOUT_S if seconds is None else seconds
    whole = bytearray()

    def keep(chunk: bytes) -> None:
        if len(whole) + len(chunk) > MAX_GIT_OUTPUT:
            raise Sm121Error(f"git {args[0]} printed more than {MAX_GIT_OUTPUT >> 20} MiB: "
                             "stopped")
        whole.extend(chunk)

    try:
        done = run(Program(("git", *_SAFE_GIT, *args), limit, f"git {args[0]}",
                           cwd=cwd, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"}),
                   sink or keep)
    except OSError as exc:
        raise Sm121Error(f"git does not run: {exc}") from None
    if done.timed_out:
        raise Sm121Error(f"git {args[0]} gave no result in {limit:g} s: stopped")
    return GitResult(done.returncode, whole.decode("utf-8", "surrogateescape"),
                     done.stderr.decode("utf-8", "replace"))


def resolve_checkout(path: Path) -> str:
    result = _git("rev-parse", "HEAD", cwd=path)
    if result.returncode != 0:
        raise Sm121Error(f"{path} is not a git checkout: {result.stderr.strip()}")
    return result.stdout.strip()


@dataclass(frozen=True)
class Checkout:
    """A --source tree as it will be built: its commit and any change git sees on top."""

    path: Path
    commit: str
    changes: str  # sha256 of the uncommitted changes ("" for a clean tree)
    other_commit: str  # why the commit is not the image's ("" when it is)


def require_vllm_tree(path: Path) -> None:
    missing = [n for n in ("CMakeLists.txt", "cmake/utils.cmake") if not (path / n).is_file()]
    if missing:
        raise Sm121Error(f"{path} is not a vLLM source tree (no {' or '.join(missing)})")


def check_checkout(path: Path, ref: GitRef, allow_other_commit: bool = False) -> Checkout:
    """Refuse a tree that is not vLLM, or at another commit than the image's (unless told);
    hash what is uncommitted so the content key covers the source actually built."""
    require_vllm_tree(path)
    return check_git_tree(path, ref, allow_other_commit, "the image's vLLM", "--source")


def check_git_tree(path: Path, ref: GitRef, allow_other_commit: bool, what: str,
                   option: str) -> Checkout:
    """A local checkout at `ref` (or told to build it anyway), with its changes hashed."""
    commit = resolve_checkout(path)
    if ref.kind == "commit":
        expected = commit if commit.startswith(ref.value) else ref.value
    else:
        found = _git("rev-parse", "--verify", "-q", f"{ref.value}^{{commit}}", cwd=path)
        expected = found.stdout.strip() if found.returncode == 0 else f"tag {ref.value} (absent)"
    other = ""
    if expected != commit:
        shown = expected[:12] if _HASH.match(expected) else expected
        other = f"{option} {path} is at {commit[:12]}; {what} is {shown}"
        if not allow_other_commit:
            raise Sm121Error(f"{other}: check that commit out, or pass --allow-other-commit "
                             "(recorded in the report)")
    return Checkout(path, commit, _changes(path), other)


def _changes(path: Path) -> str:
    """sha256 over `git diff HEAD` and every untracked, not ignored file (name and bytes)."""
    diffed = hashlib.sha256()
    size = [0]

    def hashed(chunk: bytes) -> None:
        diffed.update(chunk)
        size[0] += len(chunk)

    diff = _git("diff", "--no-ext-diff", "--no-textconv", "HEAD", "--binary", cwd=path,
                sink=hashed)
    others = _git("ls-files", "--others", "--exclude-standard", "-z", cwd=path)
    if diff.returncode != 0 or others.returncode != 0:
        raise Sm121Error(f"{path}: git cannot list its changes: "
                         f"{(diff.stderr or others.stderr).strip()}")
    names = sorted(n for n in others.stdout.split("\0") if n)
    if not size[0] and not names:
        return ""
    digest = diffed.copy()
    for name in names:
        digest.update(b"\0" + name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            digest.update(hashlib.sha256(read_input(path / name, MAX_UNTRACKED,
                                                    "untracked file")).digest())
        except InputRefused as exc:
            raise Sm121Error(f"{path / name}: cannot read it: "
                             f"{str(exc).removeprefix(f'{path / name}: ')}") from None
    return digest.hexdigest()


def fetch_source(ref: GitRef, repo: str = UPSTREAM, dest_root: Path | None = None,
                 name: str = "vllm") -> tuple[Path, str]:
    """Check the ref out under the cache (shallow where git allows); returns (dir, commit)."""
    if shutil.which("git") is None:
        raise Sm121Error(f"git not found: install git to fetch {name} source, or pass a "
                         "local checkout")
    root = dest_root or cache_dir() / "src"
    key = re.sub(r"[^A-Za-z0-9._-]", "_", f"{name}-{ref.value}")
    dest = root / key
    if dest.exists() and (dest / ".git").exists():
        commit = _clean_at(dest, ref)
        if commit is not None:
            return dest, commit
        notice(f"note: the cached checkout {dest} was not clean at {ref}: fetched again")
        shutil.rmtree(dest)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        commit = _fetch_into(work, ref, repo)
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
        return dest, commit
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _clean_at(path: Path, ref: GitRef) -> str | None:
    """The commit of a cached checkout (the cache is untrusted) when git itself says it is
    at `ref` with nothing on top: HEAD is that commit (for a tag, the tag names HEAD's
    commit) and `git status` lists no change, untracked or ignored file; else None."""
    head = _git("rev-parse", "--verify", "-q", "HEAD^{commit}", cwd=path)
    commit = head.stdout.strip()
    if head.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None
    if ref.kind == "tag":
        tagged = _git("rev-parse", "--verify", "-q", f"refs/tags/{ref.value}^{{commit}}",
                      cwd=path)
        if tagged.returncode != 0 or tagged.stdout.strip() != commit:
            return None
    elif not commit.startswith(ref.value):
        return None
    status = _git("status", "--porcelain", "--ignored", "--untracked-files=all",
                  "--ignore-submodules=none", cwd=path)
    if status.returncode != 0 or status.stdout.strip():
        return None
    return commit


def _fetch_into(work: Path, ref: GitRef, repo: str) -> str:
    _check(_git("init", "-q", str(work)), "git init")
    _check(_git("remote", "add", "origin", repo, cwd=work), "git remote add")
    if ref.kind == "tag":
        spec = f"+refs/tags/{ref.value}:refs/tags/{ref.value}"
        fetched = _git("fetch", "-q", "--depth", "1", "origin", spec, cwd=work,
                       seconds=GIT_TIMEOUT_S)
        if fetched.returncode != 0:
            raise Sm121Error(f"tag {ref.value} not found in {repo}: "
                             f"{_last(fetched.stderr)}")
        target = ref.value
    else:
        fetched = _git("fetch", "-q", "--depth", "1", "origin", ref.value, cwd=work,
                       seconds=GIT_TIMEOUT_S)
        if fetched.returncode != 0:  # abbreviated hash, or a server that refuses SHA wants
            full = _git("fetch", "-q", "origin", "+refs/heads/*:refs/remotes/origin/*",
                        "+refs/tags/*:refs/tags/*", cwd=work, seconds=GIT_TIMEOUT_S)
            if full.returncode != 0:
                raise Sm121Error(f"cannot fetch {repo}: {_last(full.stderr)}")
        resolved = _git("rev-parse", "--verify", "-q", f"{ref.value}^{{commit}}", cwd=work)
        if resolved.returncode != 0:
            resolved = _git("rev-parse", "--verify", "-q", "FETCH_HEAD^{commit}", cwd=work)
            if resolved.returncode != 0 or not resolved.stdout.startswith(ref.value):
                raise Sm121Error(f"commit {ref.value} not found in {repo}")
        target = resolved.stdout.strip()
    _check(_git("-c", "advice.detachedHead=false", "checkout", "-q", target, cwd=work),
           f"git checkout {target}")
    commit = resolve_checkout(work)
    if ref.kind == "commit" and not commit.startswith(ref.value):
        raise Sm121Error(f"checked out {commit} but {ref.value} was asked for from {repo}")
    return commit


def update_submodules(path: Path, wanted: tuple[str, ...]) -> None:
    """Check out the named submodules a build needs (shallow), if the tree declares them."""
    modules = path / ".gitmodules"
    if not wanted or not modules.is_file():
        return
    listed = _git("config", "-f", str(modules), "--get-regexp", r"submodule\..*\.path",
                  cwd=path).stdout.split()[1::2]
    for sub in (w for w in wanted if w in listed):
        if (path / sub).is_dir() and any((path / sub).iterdir()):
            continue
        _check(_git("submodule", "update", "--init", "--depth", "1", "--", sub, cwd=path,
                    seconds=GIT_TIMEOUT_S),
               f"git submodule update {sub}")


def _last(stderr: str) -> str:
    """git's own reason: its first `fatal:`/`error:` line (the lines after it are advice,
    such as "and the repository exists.")."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    reasons = [line for line in lines if line.startswith(("fatal:", "error:"))]
    return (reasons or lines or ["no output"])[0]


def _check(result: GitResult, what: str) -> None:
    if result.returncode != 0:
        raise Sm121Error(f"{what} failed: {_last(result.stderr)}")


def _ref(pin: ProjectPin) -> GitRef:
    return GitRef("commit" if re.fullmatch(r"[0-9a-f]{7,40}", pin.commit) else "tag",
                  pin.commit)


def copy_into(pin: ProjectPin, local: Path | None, dest: Path,
              allow_other_commit: bool = False) -> Checkout:
    """`bring` the project, then copy its tree (without .git) to `dest` for the build."""
    got = bring(pin, local, allow_other_commit)
    require_contained(got.path)  # the copy keeps links as links, all inside
    shutil.copytree(got.path, dest, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    return got


def bring(pin: ProjectPin, local: Path | None, allow_other_commit: bool = False) -> Checkout:
    """The project at the pinned commit: a local checkout (checked) or fetched into the cache
    with the submodules its build needs."""
    if local is not None:
        require_project_tree(local, pin.project.name)
        return check_git_tree(local, _ref(pin), allow_other_commit,
                              f"the {pin.project.name} commit {pin.declared_in} pins",
                              "--fa-source")
    path, commit = fetch_source(_ref(pin), pin.repository, name=pin.project.name)
    update_submodules(path, pin.project.submodules)
    return Checkout(path, commit, "", "")
