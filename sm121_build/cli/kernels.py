"""`sm121-build kernels publish`: verified artifacts as a kernels image in a registry."""

from __future__ import annotations

from pathlib import Path

import click

from sm121_build.cli.params import InputPath, sign_key_option, signing_key, trust_key_option
from sm121_build.core.console import notice, say, say_json, shown
from sm121_build.image.cosign import TrustKey, Untrusted, attested, require_signed
from sm121_build.image.refs import split_ref, validate_image_ref
from sm121_build.image.registry import Registry
from sm121_build.jobs.formats.artifacts import load
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.kernel_images.kernels_image import (
    PROVENANCE_TYPE,
    Publication,
    attach_proof,
    proof_line,
    provenance_files,
    publish,
    require_repository,
)
from sm121_build.jobs.proofs.proof_reading import (
    read_proof,
    require_proof_of,
    require_verdict,
)


@click.group()
def kernels() -> None:
    """Kernels images: the rebuilt .so files of a verified run, in any container registry."""


@kernels.command("verify")
@click.argument("ref")
@trust_key_option("The public key (cosign.pub) the image must be signed with.", required=True)
def verify_command(ref: str, trust_key: Path) -> None:
    """Check that REF (REPO:TAG or REPO@DIGEST) carries a signature by the key for exactly
    its digest, and print the signed provenance (exit 3 when it does not hold).  Asks the
    registry only: nothing is pulled."""
    validate_image_ref(ref)
    trust = TrustKey.load(trust_key)
    name, tag, digest = split_ref(ref)
    registry = Registry(name)
    digest = digest or registry.digest(tag or "latest")
    require_signed(registry, digest, trust)
    notice(f"{name}@{digest}: signed by {trust_key}")
    try:
        provenance = attested(registry, digest, trust, PROVENANCE_TYPE)
    except Untrusted as exc:
        notice(f"note: {exc}")
        return
    notice(proof_line(registry, digest, trust, provenance_files(provenance)))
    say_json(provenance, sort_keys=True)


@kernels.command("attest")
@click.argument("ref")
@click.option("--proof", type=InputPath(dir_okay=False, exists=True, path_type=Path),
              required=True, help="The proof (`sm121-build prove --json PROOF`) to attach.")
@sign_key_option("The key that signed REF's provenance (`--kernels-to --sign-key`); it "
                 "signs the proof's statement too.", required=True)
@trust_key_option("Attach the proof only when PROOF.sig is signed by this public key "
                  "(`prove --sign-key`); exit 3 otherwise.")
@click.option("--partial-proof", "partial", is_flag=True,
              help="Attach a partial proof (some added kernels never launched by a case) "
                   "as partial: its statement carries its coverage, and `kernels verify` "
                   "and `--kernels-from` say \"partial (proven for X of Y added kernels; "
                   "...)\".  Without it a partial proof is refused (exit 3).")
def attest_command(ref: str, proof: Path, sign_key: Path, trust_key: Path | None,
                   partial: bool) -> None:
    """Attach a proof beside the kernels image REF already in its registry, as `publish
    --proof` does: checked against the files REF's signed provenance lists (proven, byte for
    byte, on the GPU they serve), then signed with the key that signed that provenance.
    Asks the registry only: nothing is pulled.  How a nightly publishes (`--kernels-to`),
    proves the image on the Spark, then attaches the proof."""
    validate_image_ref(ref)
    signing = signing_key(sign_key)
    read = read_proof(proof, TrustKey.load(trust_key) if trust_key else None)
    require_verdict(read[1], str(proof), partial)  # before the registry is asked
    notice(read[1].line())
    say(shown(attach_proof(ref, read, signing, sign_key, partial)))


@kernels.command("publish")
@click.option("--artifacts", "folder", required=True,
              type=InputPath(file_okay=False, exists=True, path_type=Path),
              help="Folder written by `sm121-build --base IMAGE --out DIR`.")
@click.option("--to", "repo", required=True, metavar="REPO",
              help="Repository to push to (e.g. ghcr.io/you/vllm-sm121-kernels); the "
                   "engine's `docker login` is used.")
@click.option("--tag", "extra", multiple=True, metavar="TAG",
              help="Also this tag (e.g. the base's moving tag, `nightly`); repeatable.")
@sign_key_option("Sign what was pushed with this ECDSA P-256 PEM key, in cosign's format "
                   "(a passphrase from COSIGN_PASSWORD).")
@click.option("--replace-tag", is_flag=True,
              help="Move a local tag that names an image this tool did not give it (the "
                   "image itself stays); without it such a tag is refused.")
@trust_key_option("Publish DIR only when its manifest.json is signed by this public key "
                  "(manifest.json.sig, written by `--out DIR --sign-key KEY`), and --proof "
                  "only when PROOF.sig is (`prove --sign-key`); exit 3 otherwise.")
@click.option("--proof", type=InputPath(dir_okay=False, exists=True, path_type=Path),
              help="Attach this proof (`sm121-build prove --json PROOF` of these files, "
                   "proven) as a statement --sign-key signs; `kernels verify` and "
                   "`--kernels-from` show it.  Refused (exit 3) when it is not of DIR's files, "
                   "byte for byte, on the GPU they serve, or partial without "
                   "--partial-proof.")
@click.option("--partial-proof", "partial", is_flag=True,
              help="Attach a partial proof (some added kernels never launched by a case) "
                   "as partial: its statement carries its coverage, and `kernels verify` "
                   "and `--kernels-from` say \"partial (proven for X of Y added kernels; "
                   "...)\".  Without it a partial proof is refused (exit 3).")
def publish_command(folder: Path, repo: str, extra: tuple[str, ...],  # noqa: PLR0913
                    sign_key: Path | None, replace_tag: bool, trust_key: Path | None,
                    proof: Path | None, partial: bool) -> None:
    """Build the kernels image of DIR (FROM scratch: the files at their paths in the base,
    the manifest, labels) and push it as REPO:k-<reuse key>, REPO:<version>-<commit>-<cuXYZ>-<arch>
    and REPO:<TAG>."""
    require_repository(repo, "--to")
    if proof is not None and sign_key is None:
        raise click.UsageError("--proof is attached as a statement the key signs: give "
                               "--sign-key KEY")
    if partial and proof is None:
        raise click.UsageError("--partial-proof says how --proof is attached: give --proof")
    signing = signing_key(sign_key) if sign_key else None
    trusted = TrustKey.load(trust_key) if trust_key else None
    found = load(folder, trusted)  # every file and its sha256 before the engine is asked
    attached = None
    if proof is not None:  # and the proof, before the engine is asked
        attached, summary = read_proof(proof, trusted)
        require_proof_of(summary, found.manifest.digests,
                         found.provenance.served, str(proof), partial)
        notice(summary.line())
    pipeline = Pipeline.connect()
    log = pipeline.new_log("kernels")
    for tag in publish(pipeline.engine, found,
                       Publication(repo, extra, signing, replace_tag=replace_tag,
                                   proof=attached), log):
        say(shown(tag))
