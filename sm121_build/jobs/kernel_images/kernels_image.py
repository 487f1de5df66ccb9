"""Build once, inject everywhere: verified artifacts as a small image any registry carries.

A kernels image is `FROM scratch` and holds only the injected `.so` files at their paths in
the base (`<package_dir>/<name>`) and the manifest at `/sm121-build/manifest.json`, with
labels saying what they fit.  It is a normal image, so the engine pushes and pulls it with
the user's `docker login`, credential helpers, mirrors and insecure-registry settings: no
registry client here.

Tags: `k-<reuse key>` (what a consumer looks up), `<vLLM version>-<commit>-<cuXYZ>-<arch>`
(immutable, for pinning and rollback) and any the publisher adds (the base's moving tag).
The reuse key is what injection needs to match, not the base image: vLLM commit, torch
version (its `+cuXYZ` names the CUDA build), arch list, guard rules, extensions.

Consuming reads the manifest and the files back through the engine's reader (never starting
anything), refuses an image holding anything it does not declare, and hands the folder to
`artifacts.load`, which checks every sha256: the local verification of `inject` then runs as
for any artifacts folder (paths, host code, kernels, ABI), and with a trusted key
(`--trust-key`) the image must carry that key's signature of its digest, checked before the
pull (`image/cosign.py`).  What verification cannot judge without one is who compiled the
code: a signature says that.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import shutil
import tarfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sm121_build.core.console import LiveLine, end_status_line, note
from sm121_build.core.errors import (
    EngineUnavailable,
    ManifestUnknown,
    RegistryUnavailable,
    Sm121Error,
)
from sm121_build.core.interrupts import temp_dir
from sm121_build.core.labels import FIELD_LABELS, KIND_LABEL, REUSE_KEY_LABEL
from sm121_build.cuda.binary import DEFAULT_POLICY, Policy
from sm121_build.cuda.compat import ArchList, is_default_gpu
from sm121_build.image import cosign, ledger
from sm121_build.image.api import ImageEngine, ImageFiles, StatusLine
from sm121_build.image.facts import VllmInstall
from sm121_build.image.refs import IMAGE_ID, split_ref, validate_image_ref
from sm121_build.image.registry import Registry
from sm121_build.jobs.formats import artifacts as artifacts_mod
from sm121_build.jobs.formats.render import render_kernels
from sm121_build.jobs.framework import run_record
from sm121_build.jobs.framework.pipeline import TagRule, require_tags_free
from sm121_build.jobs.proofs.proof_reading import (
    PROOF_TYPE,
    NotAProof,
    ProofSummary,
    require_proof_of,
    summarise,
)

if TYPE_CHECKING:
    from sm121_build.jobs.framework.pipeline import Pipeline

MANIFEST_PATH = "sm121-build/manifest.json"
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def reuse_key(manifest: artifacts_mod.Manifest) -> str:
    """What injection needs to match: the same vLLM commit, torch, arch list, rules and
    extensions give the same key on any base (arm64 or a re-pushed tag alike)."""
    built = manifest.provenance
    parts = [built.vllm_commit_id or built.vllm_commit, built.torch_version or "",
             built.arch_list, built.patches, ",".join(manifest.names)]
    if built.platform:  # arm64 and amd64 files of one build are two kernels images
        parts.append(built.platform)
    if not is_default_gpu(built.served):  # one build per GPU; the Spark's keys stay as they were
        parts.append(f"gpu={built.served}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def cuda_flavour(torch_version: str) -> str:
    """`cu130` of `2.11.0+cu130`: vLLM's release pipeline ships one commit for several CUDA
    builds (`nightly`, `cu129-nightly`, ...), whose torch differ; empty when torch names none."""
    local = torch_version.partition("+")[2]
    return local if re.fullmatch(r"cu\d+", local) else ""


def pinned_tag(version: str, commit: str, arch_list: ArchList,
               torch_version: str = "") -> str:
    """`<vLLM version>-<commit12>[-cuXYZ]-<arch>`: the tag a base's own facts name (the
    lookup); immutable, for pinning and rollback."""
    parts = [version, commit[:12], cuda_flavour(torch_version), arch_list.tag]
    return _TAG_UNSAFE.sub("_", "-".join(p for p in parts if p))[:128]


def tags_for(repo: str, manifest: artifacts_mod.Manifest, extra: tuple[str, ...] = ()) -> list[str]:
    """`repo:k-<key>`, `repo:<version>-<commit12>[-cuXYZ]-<arch>`, and `repo:<extra>` for
    each."""
    built = manifest.provenance
    pinned = pinned_tag(built.vllm_version, built.vllm_commit_id or built.vllm_commit,
                        built.archs, built.torch_version or "")
    return list(dict.fromkeys([
        f"{repo}:k-{reuse_key(manifest)}", f"{repo}:{pinned}",
        *(f"{repo}:{_TAG_UNSAFE.sub('_', t)[:128]}" for t in extra)]))


def moving_tag(base: str) -> str:
    """The base's own tag (`nightly` of `vllm/vllm-openai:nightly`): the kernels image's
    moving tag; none for a base named by digest or image ID."""
    if IMAGE_ID.match(base):
        return ""
    _name, tag, digest = split_ref(base)
    return "" if digest else tag or "latest"


class KernelsNotFound(Sm121Error):
    """The registry has no such kernels image (a miss, not a failure)."""




def _labels(manifest: artifacts_mod.Manifest) -> dict[str, str]:
    """The names the built images use (`render.provenance_labels`), plus what a kernels
    image adds: torch, the commit id, the reuse key, its kind."""
    values: dict[str, object] = manifest.provenance.as_json()
    labels = {label: str(values[key]) for key, label in FIELD_LABELS.items()
              if key != "extensions" and values.get(key)}
    labels[FIELD_LABELS["extensions"]] = ",".join(manifest.names)
    labels[REUSE_KEY_LABEL] = reuse_key(manifest)
    labels[KIND_LABEL] = "kernels"
    return labels


def package_root(manifest: artifacts_mod.Manifest) -> str:
    """The folder of the base the files go to, relative (`usr/local/lib/.../vllm`)."""
    written = manifest.provenance.package_dir
    root = posixpath.normpath("/" + written).lstrip("/")
    if not root or root.startswith(".."):
        raise Sm121Error(f"the manifest names no package folder ({written!r})")
    return root


PROVENANCE_TYPE = "https://sm121-build.dev/provenance/v1"


@dataclass(frozen=True)
class Publication:
    """Where a kernels image goes and how it is vouched for: the repository, tags beyond
    the two it always gets, the key that signs it, and what the run adds to its provenance
    (the plan, the content key, the sources)."""

    repo: str
    extra_tags: tuple[str, ...] = ()
    sign_key: cosign.SigningKey | None = None
    run: dict[str, Any] = field(default_factory=dict)
    replace_tag: bool = False  # a local tag on an image this tool did not give it may move
    proof: dict[str, Any] | None = None  # `prove`'s document of these files, checked


def publish(engine: ImageEngine, found: artifacts_mod.Artifacts, target: Publication,
            log: Path) -> list[str]:
    """Build the kernels image of a checked artifacts folder, tag it, push every tag; with a
    key, sign what the registry now holds and attach the build's provenance (the manifest
    and the run) as a signed statement, both in cosign's format beside it."""
    manifest = found.manifest
    repo = target.repo
    tags = tags_for(repo, manifest, target.extra_tags)
    root = package_root(manifest)
    rule = TagRule(target.replace_tag, "", None, _a_kernels_image, "the tag")
    require_tags_free(engine, tags, rule)  # before the build: a user's tag never moves
    with temp_dir("sm121-kernels-") as tmp:
        context = Path(tmp)
        found.place(context / "root" / root)
        (context / "root" / MANIFEST_PATH).parent.mkdir(parents=True)
        shutil.copyfile(found.folder / artifacts_mod.MANIFEST, context / "root" / MANIFEST_PATH)
        (context / "Dockerfile").write_text(render_kernels(_labels(manifest)))
        image_id = engine.build(context, context / "Dockerfile", log)
    # written before the tags exist: `prune` knows every local tag this run gives
    require_tags_free(engine, tags, replace(rule, image_id=image_id))  # and just before
    ledger.record_built(image_id, tags, "", f"{KERNELS_OF}{manifest.provenance.base}")
    for tag in tags:
        engine.tag(image_id, tag)
    for tag in tags:
        engine.push(tag)
        note(f"pushed {tag}")
    if target.sign_key is not None:
        digest = engine.resolve_digest(tags[0])  # what every tag names in the registry
        registry = Registry(repo)
        note(f"signed {repo}@{digest}: {cosign.sign(registry, digest, target.sign_key)}")
        attached = cosign.attest(registry, digest, target.sign_key, PROVENANCE_TYPE,
                                 {"manifest": manifest.as_json(), "run": target.run})
        note(f"provenance attached: {attached}")
        if target.proof is not None:
            attached = cosign.attest(registry, digest, target.sign_key, PROOF_TYPE,
                                     target.proof)
            note(f"proof attached: {attached}")
    return tags


def attach_proof(ref: str, proof: tuple[dict[str, Any], ProofSummary],
                 key: cosign.SigningKey, key_path: Path, partial: bool = False) -> str:
    """`kernels attest`: a checked proof attached beside a kernels image already in its
    registry, as `publish --proof` attaches it, and signed by the key that signed the image's
    provenance (its statement is how the image's files are known: nothing is pulled); a
    partial one only when `partial` (`--partial-proof`).  Returns the statement's tag."""
    name, tag, digest = split_ref(ref)
    registry = Registry(name)
    digest = digest or registry.digest(tag or "latest")
    signed = cosign.attested(registry, digest, key.public(key_path), PROVENANCE_TYPE)
    listed = signed.get("manifest")
    if not isinstance(listed, dict):
        raise Sm121Error(f"{name}@{digest}: its provenance names no manifest")
    manifest = artifacts_mod.Manifest.from_json(listed)
    document, summary = proof
    require_proof_of(summary, manifest.digests,
                     manifest.provenance.served, f"the proof for {name}@{digest}", partial)
    return cosign.attest(registry, digest, key, PROOF_TYPE, document)


def provenance_files(provenance: Mapping[str, Any]) -> dict[str, str]:
    """The files (name -> sha256) a signed provenance statement's manifest lists."""
    listed = provenance.get("manifest")
    return artifacts_mod.Manifest.from_json(listed).digests if isinstance(listed, dict) \
        else {}


def proof_line(registry: Registry, digest: str, trust: cosign.TrustKey,
               files: Mapping[str, str]) -> str:
    """What the proof `trust` signed beside the kernels image at `digest` says, in one line
    (`proven on NVIDIA GB10 (sm_121), ...`), checked against the image's files (name ->
    sha256); else why there is none to show.  Never fails the caller: a proof is shown, not
    required."""
    try:
        summary = summarise(cosign.attested(registry, digest, trust, PROOF_TYPE))
    except cosign.Untrusted:
        return (f"note: no proof signed by {trust.path} is attached (`sm121-build prove`, "
                "then `kernels publish --proof`)")
    except NotAProof as exc:
        return f"note: the proof attached is not one: {exc}"
    except Sm121Error as exc:
        return f"note: the proof attached could not be read: {exc}"
    why = summary.mismatch(files)
    if why:
        return f"note: the proof attached is not of these files ({why}): not shown"
    return summary.line()


KERNELS_OF = "kernels image of "


def _a_kernels_image(entry: ledger.Built) -> bool:
    """A kernels image this tool built may give up its tags to another (`nightly` moves)."""
    return entry.base_ref.startswith(KERNELS_OF)


class RegistryError(RegistryUnavailable):
    """The registry could not be asked (down, refused the login, no answer in time, ...):
    not the image's fault (exit 7)."""


@dataclass(frozen=True)
class Fetched:
    """A kernels image read back: its checked artifacts and the digest it was pulled by."""

    artifacts: artifacts_mod.Artifacts
    digest: str


def publish_step(pipeline: Pipeline, folder: Path, repo: str, base: str,
                 replace_tag: bool = False) -> list[str]:
    """`--kernels-to`: the run's verified artifacts as a kernels image, pushed (after
    verification, never before) as `k-<reuse key>`, `<version>-<commit>-<cuXYZ>-<arch>` and
    the base's moving tag."""
    found = artifacts_mod.load(folder)
    with pipeline.steps.step(f"publish kernels to {repo}"):
        moving = moving_tag(base)
        record = pipeline.record
        run = {"decision": record.decision.as_json() if record.decision else None,
               "content_key": record.content_key,
               "base_digest": record.base_digest, "source_changes": record.source_changes,
               "source_other_commit": record.source_other_commit,
               "external": {k: asdict(v) for k, v in record.external.items()}}
        tags = publish(pipeline.engine, found,
                       Publication(repo, (moving,) if moving else (), pipeline.sign_key,
                                   {k: v for k, v in run.items() if v}, replace_tag),
                       pipeline.new_log("kernels", recorded=False))
        pipeline.record.kernels_pushed(tags)
    return tags


def fetch(engine: ImageEngine, ref: str, dest: Path, status: StatusLine | None = None,
          trust: cosign.TrustKey | None = None) -> Fetched:
    """Resolve `ref` to its digest, (with `trust`: refuse it unless that key signed that
    digest, before anything is pulled), pull exactly that, and read it back into an
    artifacts folder at `dest`, checked: a kernels image (its label), the manifest's files
    and nothing else, every sha256.  The pulled image is removed again unless it was here
    before."""
    name, _tag, digest = split_ref(ref)
    try:
        digest = digest or engine.resolve_digest(ref)
    except EngineUnavailable:
        raise
    except ManifestUnknown as exc:
        raise KernelsNotFound(str(exc)) from None
    except Sm121Error as exc:
        raise RegistryError(str(exc)) from None
    if trust is not None:
        cosign.require_signed(Registry(name), digest, trust)
    before = engine.image_ids()
    try:
        image_id = engine.pull(f"{name}@{digest}", status)
    except EngineUnavailable:
        raise
    except Sm121Error as exc:
        raise RegistryError(str(exc)) from None
    try:
        fetched = Fetched(_read_back(engine, ref, image_id, dest), digest)
    finally:
        engine.remove_created(image_id, before)
    if trust is not None:  # signed: what its signed proof says, if it has one
        note(proof_line(Registry(name), digest, trust, fetched.artifacts.manifest.digests))
    return fetched


def _read_back(engine: ImageEngine, ref: str, image_id: str,
               dest: Path) -> artifacts_mod.Artifacts:
    info = engine.image(image_id)
    if info.labels.get(KIND_LABEL) != "kernels":
        raise Sm121Error(f"{ref} is not a kernels image (no {KIND_LABEL}=kernels label): "
                         "publish one with `sm121-build kernels publish`")
    dest.mkdir(parents=True, exist_ok=True)
    with engine.reader(image_id) as files:
        raw = files.read_bytes("/" + MANIFEST_PATH, limit=16 << 20)
        if raw is None:
            raise Sm121Error(f"{ref}: no /{MANIFEST_PATH}")
        (dest / artifacts_mod.MANIFEST).write_bytes(raw)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):
            raise Sm121Error(f"{ref}: /{MANIFEST_PATH} is not valid JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise Sm121Error(f"{ref}: /{MANIFEST_PATH} lists no files")
        manifest = artifacts_mod.Manifest.from_json(data)
        root = package_root(manifest)
        declared = {f"{root}/{name}" for name in manifest.names}
        held = _regular_files(files, "/" + root)
        extra = sorted(held - declared)
        if extra:
            raise Sm121Error(f"{ref} holds {', '.join(extra[:3])}"
                             f"{' and more' if len(extra) > 3 else ''}, which its manifest does "
                             "not declare: refused")
        for name in manifest.names:
            if not artifacts_mod.is_file_name(name):
                raise Sm121Error(f"{ref}: {name!r} is not a .so file name")
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            if files.copy_file(f"/{root}/{name}", dest / name) is None:
                raise Sm121Error(f"{ref}: declares {name}, which it does not hold")
    return artifacts_mod.load(dest)  # every sha256 against the manifest


def fetch_step(pipeline: Pipeline, ref: str, dest: Path) -> Fetched:
    """`fetch` as a step of the run, with the pull's progress and what it brought."""
    live = LiveLine()
    got = fetch(pipeline.engine, ref, dest, live, pipeline.trust_key)
    end_status_line()
    if live.last.startswith("pulled "):
        note(live.last)
    key = reuse_key(got.artifacts.manifest)
    note(f"{ref} is {got.digest} (reuse key {key})")
    pipeline.record.kernels_looked_up(run_record.KernelsFrom(ref, "hit", got.digest, key))
    return got


def require_repository(repo: str, option: str) -> None:
    """A repository reference without a tag or digest (the tags are chosen here)."""
    validate_image_ref(repo)
    if ":" in repo.rsplit("/", 1)[-1] or "@" in repo:
        raise Sm121Error(f"{option} {repo}: a repository without a tag (tags are chosen here)")


@dataclass(frozen=True)
class Wanted:
    """What a kernels image must have been built for: this base (pulled first as `pull`
    says) and this arch list."""

    base: str
    arch: ArchList
    pull: str = "never"
    gpu: Policy = DEFAULT_POLICY  # a kernels image made for another GPU is refused


def look_up(pipeline: Pipeline, repo: str, wanted: Wanted,
            dest: Path) -> artifacts_mod.Artifacts | None:
    """The kernels image of this base's vLLM build in `repo`
    (`<version>-<commit>-<cuXYZ>-<arch>`), fetched and checked, or None when there is none
    to use: a miss, the registry unreachable, or one built for another vLLM or torch (each
    said in one line and recorded).  The base is resolved (and pulled) first."""
    base, arch = wanted.base, wanted.arch
    facts, vllm = pipeline.resolve_image(base, wanted.pull)
    ref = f"{repo}:{pinned_tag(vllm.version, vllm.commit_id or '', arch, vllm.torch_version or '')}"
    record = pipeline.record
    with pipeline.steps.step(f"kernels {ref}"):
        try:
            got = fetch_step(pipeline, ref, dest)
        except KernelsNotFound:
            note(f"no kernels image {ref}: a miss")
            record.kernels_looked_up(run_record.KernelsFrom(ref, "miss", why="not in the registry"))
            return None
        except RegistryError as exc:
            note(f"{exc}: no kernels from {repo}")
            record.kernels_looked_up(run_record.KernelsFrom(ref, "unreachable", why=str(exc)))
            return None
        except cosign.Untrusted as exc:
            note(f"{exc}: not used")
            record.kernels_looked_up(run_record.KernelsFrom(ref, "refused", why=str(exc)))
            return None
        why = refusal(got.artifacts.provenance, vllm, base, facts.platform) \
            or gpu_refusal(got.artifacts.provenance, wanted.gpu)
        if why:
            note(f"{ref} {why.what}: not used")
            record.kernels_looked_up(run_record.KernelsFrom(ref, "refused", got.digest,
                                                            reuse_key(got.artifacts.manifest),
                                                            why.what))
            return None
        note("a hit: inject and verify, no compile")
    return got.artifacts


@dataclass(frozen=True)
class Refusal:
    """Why files cannot go into a base (`what`: "were built for vLLM …"), and what would
    explain it to the user (`hint`: "" or " (torch's C++ ABI changes …)")."""

    what: str
    hint: str = ""


def refusal(built: artifacts_mod.Provenance, vllm: VllmInstall, base: str,
            platform: str = "") -> Refusal | None:
    """Why files built as `built` say cannot go into `base` (another platform, another vLLM
    version or commit, or another torch); None when they fit."""
    if built.platform and platform and built.platform != platform:
        return Refusal(f"were made for {built.platform}; {base} is {platform}",
                       " (an extension loads only on the platform it was compiled for)")
    if (vllm.version, vllm.commit_id or "") != (built.vllm_version, built.vllm_commit_id or ""):
        return Refusal(f"were built for vLLM {built.vllm_version} "
                       f"({built.vllm_commit_id or 'no commit id'}); {base} has "
                       f"{vllm.version} ({vllm.commit_id or 'no commit id'})")
    if built.torch_version and vllm.torch_version and built.torch_version != vllm.torch_version:
        return Refusal(f"were built against torch {built.torch_version}; {base} has torch "
                       f"{vllm.torch_version}", " (torch's C++ ABI changes between versions: "
                       "build for this image instead)")
    return None


def gpu_refusal(built: artifacts_mod.Provenance, gpu: Policy) -> Refusal | None:
    """Why files made for one GPU do not serve a run for another (an sm_120 kernels image in
    an sm_121 run, or the other way); None when they serve the same one."""
    if built.served != str(gpu):
        return Refusal(f"were made for {built.served}; this run serves {gpu}",
                       f" (files are native on the GPU they were made for: --gpu "
                       f"{built.served} uses them)")
    return None


def _regular_files(files: ImageFiles, folder: str) -> set[str]:
    """Every file under `folder` of the image, as paths without the leading slash."""
    found: set[str] = set()
    with files.tar(folder) as archive:
        member: tarfile.TarInfo
        for member in archive:
            if not member.isdir():
                rel = posixpath.normpath(member.name)
                found.add(posixpath.join(posixpath.dirname(folder.lstrip("/")), rel))
    return found
