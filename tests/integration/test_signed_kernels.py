"""Kernels images you can trust without trusting the registry: signatures in cosign's format
(`image/cosign.py`) written beside an image in a real registry on loopback and checked
there.  Independent of this tool's own verifier: the payload is compared byte for byte with
cosign's format written out here, the manifest's media types and annotation by name, and the
signature is checked by the `openssl` command line over the bytes the registry serves.  A
re-signed (another key), unsigned or re-pointed (a signature of another digest) image is
refused, and `inject --from --trust-key` refuses it in one line before anything is pulled."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from devkit.keys import key_pair, push_small
from devkit.registry import local_registry
from devkit.testtags import RUN
from sm121_build.image.cosign import SigningKey, TrustKey, Untrusted, require_signed, sign
from sm121_build.image.registry import Registry

pytestmark = [pytest.mark.docker]


def _get(url: str, accept: str = "") -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return bytes(response.read())


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    with local_registry(tmp_path) as address:
        yield address


def test_a_signature_is_cosigns_format_and_openssl_verifies_it(registry: str,
                                                               tmp_path: Path) -> None:
    client = docker.from_env()
    repo = f"{registry}/{RUN}/kernels"
    digest = push_small(client, tmp_path, f"{repo}:one", "one")
    private, public = key_pair(tmp_path, "a")
    assert sign(Registry(repo), digest, SigningKey.load(private, None)) == \
        f"{repo}:sha256-{digest.split(':')[1]}.sig"
    raw = _get(f"http://{registry}/v2/{RUN}/kernels/manifests/sha256-"
               f"{digest.split(':')[1]}.sig", "application/vnd.oci.image.manifest.v1+json")
    manifest = json.loads(raw)
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.dev.cosign.simplesigning.v1+json"
    body = _get(f"http://{registry}/v2/{RUN}/kernels/blobs/{layer['digest']}")
    assert body == (b'{"critical":{"identity":{"docker-reference":"' + repo.encode() +
                    b'"},"image":{"docker-manifest-digest":"' + digest.encode() +
                    b'"},"type":"cosign container image signature"},"optional":null}')
    (tmp_path / "payload").write_bytes(body)
    (tmp_path / "sig").write_bytes(base64.b64decode(
        layer["annotations"]["dev.cosignproject.cosign/signature"]))
    checked = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(public),
                              "-signature", str(tmp_path / "sig"), str(tmp_path / "payload")],
                             capture_output=True, text=True, check=False)
    assert checked.stdout.strip() == "Verified OK", checked.stdout + checked.stderr
    require_signed(Registry(repo), digest, TrustKey.load(public))  # our own reader agrees
    # a second signature is appended, as cosign does; either key then verifies
    other_private, other_public = key_pair(tmp_path, "b")
    sign(Registry(repo), digest, SigningKey.load(other_private, None))
    assert len(json.loads(_get(f"http://{registry}/v2/{RUN}/kernels/manifests/sha256-"
                               f"{digest.split(':')[1]}.sig",
                               "application/vnd.oci.image.manifest.v1+json"))["layers"]) == 2
    require_signed(Registry(repo), digest, TrustKey.load(other_public))


def test_unsigned_resigned_and_repointed_images_are_refused(registry: str,
                                                            tmp_path: Path) -> None:
    client = docker.from_env()
    repo = f"{registry}/{RUN}/kernels"
    one = push_small(client, tmp_path, f"{repo}:one", "one")
    two = push_small(client, tmp_path, f"{repo}:two", "two")
    private, public = key_pair(tmp_path, "ours")
    intruder, _ = key_pair(tmp_path, "theirs")
    trust = TrustKey.load(public)
    with pytest.raises(Untrusted, match=r"is not signed"):
        require_signed(Registry(repo), one, trust)
    sign(Registry(repo), one, SigningKey.load(intruder, None))  # re-signed by another key
    with pytest.raises(Untrusted, match=r"no signature of .* verifies with"):
        require_signed(Registry(repo), one, trust)
    # our signature of `one`, placed beside `two` by whoever can write the registry
    sign(Registry(repo), one, SigningKey.load(private, None))
    raw = _get(f"http://{registry}/v2/{RUN}/kernels/manifests/sha256-"
               f"{one.split(':')[1]}.sig", "application/vnd.oci.image.manifest.v1+json")
    Registry(repo).put_manifest(f"sha256-{two.split(':')[1]}.sig", raw)
    with pytest.raises(Untrusted, match=rf"is for {repo}@{one}"):
        require_signed(Registry(repo), two, trust)
    # and a signature for the same digest in another repository is not this one's
    copy = f"{registry}/{RUN}/elsewhere"
    signature = json.loads(raw)
    for blob in (signature["config"], *signature["layers"]):
        Registry(copy).put_blob(Registry(repo).blob(blob["digest"]))
    Registry(copy).put_manifest(f"sha256-{one.split(':')[1]}.sig", raw)
    with pytest.raises(Untrusted, match=r"is for"):
        require_signed(Registry(copy), one, trust)
    # the command: one line, exit 3, nothing pulled
    before = {i.id for i in client.images.list(all=True)}
    result = subprocess.run(
        [sys.executable, "-m", "sm121_build", "inject", "--from", f"{repo}:two", "--base",
         f"{RUN}/none:x", "--trust-key", str(public)],
        capture_output=True, text=True, check=False, env=dict(os.environ))
    errors = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert result.returncode == 3, result.stderr
    assert errors[0].startswith(
        f"error: the signature by {public} beside {repo}@{two} is for "), errors
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert {i.id for i in client.images.list(all=True)} == before


def test_a_key_that_is_not_p256_or_not_a_key_is_refused_first(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("not a key")
    for option in ("--trust-key",):
        result = subprocess.run(
            [sys.executable, "-m", "sm121_build", "inject", "--from", "127.0.0.1:9/k:x",
             "--base", "x/y:z", option, str(tmp_path / "junk.pem")],
            capture_output=True, text=True, check=False)
        assert result.returncode == 2
        assert result.stderr.strip().startswith(f"error: {option} {tmp_path / 'junk.pem'}: "
                                                "not a PEM public key")


def test_the_provenance_is_a_signed_in_toto_statement_openssl_verifies(
        registry: str, tmp_path: Path) -> None:
    """cosign's `attest` layout: a DSSE envelope in the `.att` manifest; its signature is
    over DSSE's pre-authentication encoding, which the test writes out from the DSSE spec
    and hands to openssl."""
    from sm121_build.image.cosign import attest, attested

    client = docker.from_env()
    repo = f"{registry}/{RUN}/kernels"
    digest = push_small(client, tmp_path, f"{repo}:one", "one")
    private, public = key_pair(tmp_path, "a")
    predicate = {"manifest": {"vllm_commit": "c" * 40, "patches": "aot-ptxas-13.0.88"},
                 "run": {"decision": {"_C": {"action": "aot"}}}}
    kind = "https://sm121-build.dev/provenance/v1"
    attest(Registry(repo), digest, SigningKey.load(private, None), kind, predicate)
    raw = _get(f"http://{registry}/v2/{RUN}/kernels/manifests/sha256-"
               f"{digest.split(':')[1]}.att", "application/vnd.oci.image.manifest.v1+json")
    (layer,) = json.loads(raw)["layers"]
    assert layer["mediaType"] == "application/vnd.dsse.envelope.v1+json"
    assert layer["annotations"]["predicateType"] == kind
    envelope = json.loads(_get(f"http://{registry}/v2/{RUN}/kernels/blobs/"
                               f"{layer['digest']}"))
    statement = base64.b64decode(envelope["payload"])
    assert json.loads(statement) == {
        "_type": "https://in-toto.io/Statement/v0.1", "predicateType": kind,
        "subject": [{"name": repo, "digest": {"sha256": digest.split(":")[1]}}],
        "predicate": predicate}
    kind_type = b"application/vnd.in-toto+json"
    (tmp_path / "pae").write_bytes(b"DSSEv1 " + str(len(kind_type)).encode() + b" " +
                                   kind_type + b" " + str(len(statement)).encode() + b" " +
                                   statement)
    (tmp_path / "sig").write_bytes(base64.b64decode(envelope["signatures"][0]["sig"]))
    checked = subprocess.run(["openssl", "dgst", "-sha256", "-verify", str(public),
                              "-signature", str(tmp_path / "sig"), str(tmp_path / "pae")],
                             capture_output=True, text=True, check=False)
    assert checked.stdout.strip() == "Verified OK", checked.stdout + checked.stderr
    assert attested(Registry(repo), digest, TrustKey.load(public), kind) == predicate
    _, other = key_pair(tmp_path, "b")
    with pytest.raises(Untrusted, match=r"no .* statement about"):
        attested(Registry(repo), digest, TrustKey.load(other), kind)
    two = push_small(client, tmp_path, f"{repo}:two", "two")  # the statement is about `one`
    Registry(repo).put_manifest(f"sha256-{two.split(':')[1]}.att", raw)
    with pytest.raises(Untrusted, match=r"no .* statement about"):
        attested(Registry(repo), two, TrustKey.load(public), kind)
