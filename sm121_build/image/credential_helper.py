"""A registry's login from the credential helper Docker's config.json names for it
(`credsStore`, `credHelpers`): the program `docker-credential-NAME get`, given the
registry's address on its stdin, answering `{"ServerURL", "Username", "Secret"}`.

The Docker SDK would run that program itself, with no deadline, in this process's group,
its output read whole (a helper that hung held a pull for as long as it hung).  So the
engine takes the helpers out of what the SDK reads (`Engine.__init__`), and a pull's or
push's login, and the registry client's (`registry._credentials`), is asked here, through
the children door: its own process group, a deadline (`HELPER_S`, or SM121_REGISTRY_TIMEOUT
when less), bounded output; what it answers is read as outside input.  A helper that is
not installed, fails, hangs or answers what is not its JSON is one line.
"""

from __future__ import annotations

import re
import shutil

from sm121_build.core.children import Program, run
from sm121_build.core.console import cut
from sm121_build.core.errors import Sm121Error
from sm121_build.core.strict_json import strict_loads

HELPER_S = 30.0  # a helper's answer, at most this late (a keychain may ask its user first)
INDEX_URL = "https://index.docker.io/v1/"  # what Docker Hub's login is stored under
_HUB = frozenset({"", "docker.io", "index.docker.io", "registry-1.docker.io"})
# what follows `docker-credential-`: a program's name on PATH, never a path
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z", re.ASCII)
_NOT_FOUND = re.compile(rb"credentials not found", re.IGNORECASE)


def helper_for(config: object, registry: str) -> str | None:
    """The credential helper Docker's config.json (`config`, as read) names for `registry`
    (`credHelpers`, Docker Hub's under `INDEX_URL`, else `credsStore`), as Docker and its
    SDK choose it; None where it names none (a value that is not a non-empty string is
    none)."""
    if not isinstance(config, dict):
        return None
    helpers = config.get("credHelpers")
    key = INDEX_URL if registry in ("", "docker.io") else registry
    named = helpers.get(key) if isinstance(helpers, dict) else None
    if not isinstance(named, str) or not named:
        named = config.get("credsStore")
    return named if isinstance(named, str) and named else None


def helper_login(helper: str, registry: str, verb: str, seconds: float = HELPER_S
                 ) -> dict[str, str]:
    """The login `docker-credential-<helper>` holds for `registry` (Docker Hub's under
    `INDEX_URL`), as the engine takes it (`X-Registry-Auth`); empty where it holds none.
    Sm121Error in one line, naming `verb` (pull, push), for a helper that cannot answer
    within `seconds` (at most `HELPER_S`: the callers give SM121_REGISTRY_TIMEOUT's, when
    less)."""
    seconds = min(seconds, HELPER_S)
    program = f"docker-credential-{helper}"
    if not _NAME.match(helper):
        raise Sm121Error(f"cannot {verb}: Docker's config.json names the credential helper "
                         f"{cut(program, 80)!r}, which is no program's name")
    found = shutil.which(program)
    if found is None:
        raise Sm121Error(f"cannot {verb}: Docker's config.json names the credential helper "
                         f"{program}, which is not installed (install it, or take it out of "
                         "config.json's credsStore/credHelpers)")
    server = INDEX_URL if registry in _HUB else registry
    try:
        done = run(Program((found, "get"), seconds, program, stdin=server.encode()))
    except OSError as exc:
        raise Sm121Error(f"cannot {verb}: {program} does not run ({cut(exc, 120)})") from None
    if done.timed_out:
        raise Sm121Error(f"cannot {verb}: {program} gave no answer in {seconds:g} s")
    if done.returncode != 0:
        if _NOT_FOUND.search(done.stdout + done.stderr):
            return {}
        raise Sm121Error(f"cannot {verb}: {program} failed (exit {done.returncode})"
                         f"{_said(done.stderr)}")
    return _login_of(done.stdout, server, program, verb)


def _said(stderr: bytes) -> str:
    """What a failed helper said on stderr, for its error line; never its stdout, where a
    helper writes a login (one that printed its answer and then failed), nor a stderr
    that holds a `Secret`."""
    text = stderr.decode("utf-8", "replace").strip()
    if not text:
        return ""
    if "Secret" in text:
        return ": (what it said holds a login, not shown)"
    return f": {cut(text, 200)}"


def _login_of(answer: bytes, server: str, program: str, verb: str) -> dict[str, str]:
    """A helper's answer as a login: a token (`Username` `<token>`) or a user and secret."""
    try:
        said = strict_loads(answer) if len(answer) <= 64 * 1024 else None
    except (ValueError, RecursionError):
        said = None
    if not isinstance(said, dict) or not isinstance(said.get("Username"), str) \
            or not isinstance(said.get("Secret"), str):
        raise Sm121Error(f"cannot {verb}: {program} answered what is not a login "
                         "(a JSON object with the strings Username and Secret)")
    if said["Username"] == "<token>":
        return {"IdentityToken": said["Secret"]}
    return {"Username": said["Username"], "Password": said["Secret"], "ServerAddress": server}
