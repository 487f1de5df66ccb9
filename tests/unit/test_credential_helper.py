"""Docker's credential helpers (config.json's `credsStore`, `credHelpers`) run through the
children door, never by the SDK: a helper that is missing, fails, hangs or answers nonsense
is one line; the login it gives reaches the engine's pull and push."""

from __future__ import annotations

import base64
import os
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docker
import pytest

from sm121_build.core.errors import Sm121Error
from sm121_build.image import credential_helper
from sm121_build.image.credential_helper import INDEX_URL
from sm121_build.image.engine import Engine


def _engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str,
            helper: str | None = None) -> Engine:
    """An engine (never reached: its socket does not exist) whose config.json is `config`,
    with `docker-credential-rt` on PATH holding `helper` (none: not installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if helper is not None:
        program = bin_dir / "docker-credential-rt"
        program.write_text(helper)
        program.chmod(0o755)
    (tmp_path / "config.json").write_text(config)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    client = docker.DockerClient(base_url=f"unix://{tmp_path}/none.sock", version="1.41",
                                 timeout=1)
    return Engine(client)


@pytest.mark.parametrize(("helper", "said"), [
    (None, "is not installed"),
    ("#!/bin/sh\necho not json\n", "answered what is not a login"),
    ("#!/bin/sh\necho '{\"Username\": 1, \"Secret\": \"s\"}'\n", "answered what is not"),
    ("#!/bin/sh\necho '{\"Username\": \"u\", \"Username\": \"v\", \"Secret\": \"s\"}'\n",
     "answered what is not"),
    ("#!/bin/sh\necho 'keychain locked' >&2\nexit 3\n", "failed (exit 3): keychain locked"),
])
def test_a_helper_that_cannot_answer_is_one_line_for_a_pull_and_a_push(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        helper: str | None, said: str) -> None:
    """Red team 5: a helper config.json names that is not installed (Docker Desktop removed,
    its `desktop` left) or answers nonsense was a traceback and the SDK's raw warning."""
    engine = _engine(tmp_path, monkeypatch, '{"credsStore": "rt"}', helper)
    for verb, call in (("pull", lambda: engine.pull("localhost:5999/k:t")),
                       ("push", lambda: engine.push("localhost:5999/k:t"))):
        with pytest.raises(Sm121Error, match=f"cannot {verb}: .*{re.escape(said)}"):
            call()
    assert "Warning" not in capfd.readouterr().err


def test_a_helper_that_hangs_is_ended_at_its_deadline_with_its_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Red team 5: the SDK ran the helper with no deadline (a `sleep 30` held a pull 30 s).
    Now it runs through the children door: ended at HELPER_S, its group killed."""
    pids = tmp_path / "pids"
    engine = _engine(tmp_path, monkeypatch, '{"credHelpers": {"localhost:5999": "rt"}}',
                     f"#!/bin/sh\nsleep 600 &\necho $! > {pids}\nwait\n")
    monkeypatch.setattr(credential_helper, "HELPER_S", 1.0)
    with pytest.raises(Sm121Error, match="docker-credential-rt gave no answer in 1 s"):
        engine.pull("localhost:5999/k:t")
    stat = Path(f"/proc/{int(pids.read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_helper_name_that_is_a_path_is_refused_and_nothing_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = tmp_path / "ran"
    (tmp_path / "bin").mkdir()
    evil = tmp_path / "bin" / "docker-credential-x"
    evil.mkdir()
    (evil / "y").write_text(f"#!/bin/sh\ntouch {ran}\n")
    (evil / "y").chmod(0o755)
    engine = _engine(tmp_path, monkeypatch, '{"credsStore": "x/y"}')
    monkeypatch.chdir(tmp_path / "bin")
    with pytest.raises(Sm121Error, match="which is no program's name"):
        engine.pull("localhost:5999/k:t")
    assert not ran.exists()


def test_the_helpers_login_is_what_the_engine_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's address on the helper's stdin (Docker Hub's under INDEX_URL); its
    answer a user and secret, or a token; a registry it holds nothing for: no login."""
    asked = tmp_path / "asked"
    engine = _engine(
        tmp_path, monkeypatch, '{"credsStore": "rt"}',
        f"#!/bin/sh\nread server\necho \"$server\" >> {asked}\n"
        "case $server in *nothing*) echo 'credentials not found in native keychain'; exit 1;;"
        " *token*) echo '{\"Username\": \"<token>\", \"Secret\": \"t0k\"}';;"
        " *) printf '{\"ServerURL\": \"%s\", \"Username\": \"u\", \"Secret\": \"s\"}' "
        "\"$server\";; esac\n")
    assert engine._login("localhost:5999/k", "pull") == {
        "Username": "u", "Password": "s", "ServerAddress": "localhost:5999"}
    assert engine._login("library/ubuntu", "pull") == {
        "Username": "u", "Password": "s", "ServerAddress": INDEX_URL}
    assert engine._login("token.example:443/k", "push") == {"IdentityToken": "t0k"}
    assert engine._login("nothing.example/k", "pull") is None
    assert asked.read_text().split() == ["localhost:5999", INDEX_URL, "token.example:443",
                                         "nothing.example"]
    given: dict[str, object] = {}

    def pull(*_args: object, **kwargs: object) -> object:
        given.update(kwargs)
        raise docker.errors.APIError("stop here")

    monkeypatch.setattr(engine.client.api, "pull", pull)
    with pytest.raises(Sm121Error):
        engine.pull("localhost:5999/k:t")
    assert given["auth_config"] == {"Username": "u", "Password": "s",
                                    "ServerAddress": "localhost:5999"}


def test_the_sdk_itself_runs_no_helper_and_keeps_the_logins_of_auths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A legacy build asks the SDK for every login (`get_all_credentials`); a pull without
    `auth_config` for its registry's: neither runs a helper, and `auths` still count."""
    ran = tmp_path / "ran"
    engine = _engine(tmp_path, monkeypatch,
                     '{"credsStore": "rt", "credHelpers": {"a.example": "rt"}, "auths": '
                     '{"localhost:5999": {"auth": "dTpw"}}}',
                     f"#!/bin/sh\ntouch {ran}\necho '{{}}'\n")
    sdk = engine.client.api._auth_configs
    assert sdk.get_credential_store("a.example") is None
    assert sdk.get_credential_store("localhost:5999") is None
    assert set(sdk.get_all_credentials()) == {"localhost:5999"}
    assert sdk.resolve_authconfig("a.example") is None
    assert not ran.exists()
    plain = _engine(tmp_path / "plain" if (tmp_path / "plain").mkdir() is None else tmp_path,
                    monkeypatch, '{"auths": {"localhost:5999": {"auth": "dTpw"}}}')
    login = plain._login("localhost:5999/k", "pull")
    assert login is not None and (login["username"], login["password"]) == ("u", "p")
    assert plain._login("elsewhere.example/k", "pull") is None


@pytest.mark.parametrize("config", ['{"credsStore": "rt"}',
                                    '{"credHelpers": {"localhost:5999": "rt"}}',
                                    '{"credsStore": "rt", "auths": {}}'])
def test_the_sdk_runs_no_helper_where_config_json_has_no_auths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """Red team 6: a config.json with a helper and no `auths` (Docker Desktop's own) was
    left to the SDK an empty AuthConfig, which it took for none read and read again from
    the file, helpers and all: a pull the helper held no login for, a push, every legacy
    build ran the helper by the SDK (no deadline, this process's group)."""
    ran = tmp_path / "ran"
    engine = _engine(tmp_path, monkeypatch, config,
                     f"#!/bin/sh\ntouch {ran}\necho 'credentials not found'\nexit 1\n")
    api = engine.client.api
    docker.auth.get_config_header(api, "localhost:5999")
    api._set_auth_headers({})
    assert not ran.exists()
    assert engine._login("localhost:5999/k", "pull") is None
    assert ran.exists()
    ran.unlink()
    docker.auth.get_config_header(api, "localhost:5999")
    assert not ran.exists()


@pytest.mark.parametrize("helper", [
    "#!/bin/sh\necho '{\"Username\": \"u\", \"Secret\": \"hunter2\"}'\nexit 1\n",
    "#!/bin/sh\necho '{\"Username\": \"u\", \"Secret\": \"hunter2\"}' >&2\nexit 1\n"])
def test_a_failed_helpers_login_is_never_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper: str) -> None:
    """Red team 6: a helper that printed its answer and then failed (exit 1) had its
    output quoted in the error line, the Secret with it.  Its stdout is never quoted, nor a
    stderr holding a Secret."""
    engine = _engine(tmp_path, monkeypatch, '{"credsStore": "rt"}', helper)
    with pytest.raises(Sm121Error, match=r"failed \(exit 1\)") as raised:
        engine.pull("localhost:5999/k:t")
    assert "hunter2" not in str(raised.value)


def test_the_registry_client_asks_the_helper_config_json_names_for_its_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernels verify`/`attest`'s registry client (`registry._credentials`, asked on a 401):
    the helper's login for the host (`credHelpers`, else `credsStore`) through the same
    door; a token is no credentials; a helper that cannot answer is one line."""
    from sm121_build.image.registry import _credentials

    asked = tmp_path / "asked"
    _engine(tmp_path, monkeypatch, '{"credHelpers": {"r.example:5000": "rt"}}',
            f"#!/bin/sh\nread server\necho \"$server\" >> {asked}\n"
            "case $server in *token*) echo '{\"Username\": \"<token>\", \"Secret\": \"t\"}';;"
            " *) echo '{\"Username\": \"u\", \"Secret\": \"s\"}';; esac\n")
    assert _credentials("r.example:5000") == ("u", "s")
    assert _credentials("other.example") is None  # no helper, no auths for it
    (tmp_path / "config.json").write_text('{"credsStore": "rt", "auths": {"token.example": '
                                          '{"auth": "dTpw"}}}')
    assert _credentials("token.example") is None  # the helper's, never auths'
    assert asked.read_text().split() == ["r.example:5000", "token.example"]
    (tmp_path / "config.json").write_text('{"credsStore": "missing"}')
    with pytest.raises(Sm121Error, match=r"cannot log in to r\.example: .*not installed"):
        _credentials("r.example")


def _refusing_registry(seen: list[str]) -> tuple[str, Callable[[], None]]:
    """A loopback registry that answers 401 (a Basic challenge) to every request, keeping
    each request's Authorization header in `seen`."""
    class Refusing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="r"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
    return f"127.0.0.1:{server.server_address[1]}", stop


def test_a_registry_that_refuses_every_login_runs_the_helper_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry answering 401 to every request (a signature list of 64 blobs) asks the
    helper once, not once for each request (a keychain that asks its user would ask 64
    times)."""
    from sm121_build.core.limits import Limits
    from sm121_build.image.registry import Registry

    asked = tmp_path / "asked"
    _engine(tmp_path, monkeypatch, '{"credsStore": "rt"}',
            f"#!/bin/sh\necho x >> {asked}\necho 'credentials not found' >&2\nexit 1\n")
    seen: list[str] = []
    host, stop = _refusing_registry(seen)
    try:
        registry = Registry(f"{host}/k", Limits(engine_s=5.0, registry_s=5.0))
        for _ in range(5):
            with pytest.raises(Sm121Error):
                registry.blob("sha256:" + "ab" * 32)
    finally:
        stop()
    assert asked.read_text().split() == ["x"]


@pytest.mark.parametrize(("secret", "sent"), [
    ("\\u043f\\n\\ud83d\\ude00", "\u043f\n\U0001f600"),
    ("\\ud83d", "?"),  # a lone surrogate: no UTF-8 holds it
])
def test_a_helpers_password_of_any_characters_is_sent_as_utf8_basic_auth(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret: str, sent: str) -> None:
    """A helper's password outside Latin-1 (or holding a newline) is sent as Basic auth of
    its UTF-8 bytes, as Docker sends it: never a traceback, never a header broken."""
    from sm121_build.core.limits import Limits
    from sm121_build.image.registry import Registry

    _engine(tmp_path, monkeypatch, '{"credsStore": "rt"}',
            "#!/bin/sh\nprintf '%s' '{\"Username\": \"u\", \"Secret\": \"" + secret +
            "\"}'\n")
    seen: list[str] = []
    host, stop = _refusing_registry(seen)
    try:
        with pytest.raises(Sm121Error, match="HTTP 401"):
            Registry(f"{host}/k", Limits(engine_s=5.0, registry_s=5.0)).manifest("t")
    finally:
        stop()
    basic = base64.b64encode(f"u:{sent}".encode()).decode()
    assert seen == ["", f"Basic {basic}"]


@pytest.mark.parametrize("config", [
    {}, {"credsStore": "s"}, {"credHelpers": {"r.example": "h"}},
    {"credsStore": "s", "credHelpers": {"r.example": "h", INDEX_URL: "hub"}},
    {"credsStore": "", "credHelpers": {"r.example": ""}}, {"credsStore": "s", "auths": {}}])
def test_the_helper_for_a_registry_is_the_one_dockers_sdk_would_choose(
        config: dict[str, object]) -> None:
    """One rule for the engine's logins and the registry client's (`helper_for`): the
    SDK's own (`AuthConfig.get_credential_store`), Docker Hub's helper under INDEX_URL."""
    from sm121_build.image.credential_helper import helper_for

    sdk = docker.auth.AuthConfig(dict(config))
    for registry in ("r.example", "docker.io", "", "other.example:5000"):
        assert helper_for(config, registry) == (sdk.get_credential_store(registry) or None), \
            (config, registry)
