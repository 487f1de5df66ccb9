"""Injectable artifacts: the built .so files plus a manifest.json saying what they fit.

    {"format": 1, "vllm_version": ..., "vllm_commit": ..., "base": ..., "base_digest": ...,
     "arch_list": ..., "tool_version": ..., "package_dir": ..., "torch_version": ...,
     "files": {"_C.abi3.so": {"sha256": ..., "mode": "755", "cubins": {...},
                              "kernels_native": N}}}

`kernels_native` counts the kernels native on the run's GPU (the manifest's `gpu`, sm_121
where it names none); a manifest of an earlier release calls it `kernels_native_sm121`,
whatever the GPU, and is read alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, BinaryIO

from sm121_build.core.console import cut
from sm121_build.core.errors import Sm121Error
from sm121_build.core.inputs import (
    copied_sha256,
    kind_of,
    read_head,
    read_input,
    require_folder,
    sha256_of,
)
from sm121_build.core.outputs import not_regular, refuse_links_below, replace_bytes, replace_file
from sm121_build.core.vllm import projects
from sm121_build.cuda.binary import DEFAULT_POLICY, gpu_of_arch_list
from sm121_build.cuda.compat import DEFAULT_ARCH, DEFAULT_GPU, ArchList
from sm121_build.cuda.elf import MAGIC as ELF_MAGIC
from sm121_build.image.cosign import SigningKey, TrustKey, Untrusted
from sm121_build.image.signed_files import has_signature, signed_beside, write_signature

MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"  # (signed_files.signature_beside the manifest)
FORMAT = 1
# A file name, or one under an external project's folder (vllm_flash_attn/_vllm_fa2_C.abi3.so)
_FILE_NAME = re.compile(
    r"^(?:(?:" + "|".join(re.escape(p.install_dir) for p in projects()) +
    r")/)?[A-Za-z0-9_][A-Za-z0-9_.+-]*\.so\Z")
_REQUIRED = ("vllm_version", "vllm_commit", "arch_list", "files")


def is_file_name(name: str) -> bool:
    """A name a manifest may list: a plain .so name, or one under an external project's
    folder."""
    return bool(_FILE_NAME.match(name))


@dataclass(frozen=True)
class Provenance:
    """What the files were built from and for: the manifest's fields besides `files`."""

    base: str
    base_digest: str
    vllm_version: str
    vllm_commit: str
    arch_list: str
    patches: str
    package_dir: str
    tool_version: str
    vllm_commit_id: str | None = None
    external: dict[str, str] = field(default_factory=dict)  # project -> commit
    torch_version: str | None = None  # the base's torch, which the files link against
    platform: str | None = None  # the base's, `linux/arm64`: what the files run on
    gpu: str | None = None  # the GPU the files are native on (`sm_121`); None: before --gpu

    @property
    def archs(self) -> ArchList:
        """The arch list as a value (the manifest's field was checked when it was read)."""
        return ArchList.parse(self.arch_list)

    @property
    def served(self) -> str:
        """The GPU the files serve: the `gpu` field, else what the arch list names alone
        (manifests written before `--gpu` existed), else the Spark's."""
        if self.gpu:
            return self.gpu
        try:
            found = gpu_of_arch_list(self.archs)
        except Sm121Error:
            found = None
        return str(found or DEFAULT_POLICY)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Provenance:
        external = data.get("external") or {}
        commit_id, torch = data.get("vllm_commit_id"), data.get("torch_version")
        platform, gpu = data.get("platform"), data.get("gpu")
        return cls(**{f.name: str(data.get(f.name) or "") for f in fields(cls)
                      if f.name not in ("vllm_commit_id", "external", "torch_version",
                                        "platform", "gpu")},
                   platform=str(platform) if platform else None,
                   gpu=str(gpu) if gpu else None,
                   vllm_commit_id=str(commit_id) if commit_id else None,
                   external={str(k): str(v) for k, v in external.items()}
                   if isinstance(external, dict) else {},
                   torch_version=str(torch) if torch else None)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        if not self.external:
            del data["external"]
        if not self.platform:
            del data["platform"]
        if not self.gpu:
            del data["gpu"]
        return data


OLD_NATIVE = "kernels_native_sm121"  # `kernels_native` as earlier releases wrote it


@dataclass(frozen=True)
class FileRecord:
    """One exported file: its hash and mode, and what verification counted in it (its
    cubins per arch, its kernels native on the run's GPU)."""

    sha256: str
    mode: str
    cubins: dict[str, int]
    kernels_native: int


    @classmethod
    def from_json(cls, data: object) -> FileRecord:
        entry = data if isinstance(data, dict) else {}
        cubins = entry.get("cubins")
        native = entry.get("kernels_native", entry.get(OLD_NATIVE))
        return cls(str(entry.get("sha256") or ""), str(entry.get("mode") or "755"),
                   {str(k): int(v) for k, v in cubins.items() if isinstance(v, int)}
                   if isinstance(cubins, dict) else {},
                   native if isinstance(native, int) else 0)


@dataclass(frozen=True)
class Manifest:
    """manifest.json, typed and versioned (`FORMAT`): what the files were built from and for
    (`Provenance`) and each file's record.  Read and written by this module only; every other
    module takes this value, never the JSON."""

    provenance: Provenance
    files: dict[str, FileRecord]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        files = data.get("files")
        return cls(Provenance.from_json(data),
                   {str(name): FileRecord.from_json(entry)
                    for name, entry in (files.items() if isinstance(files, dict) else ())})

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.provenance.as_json(),
                "files": {name: asdict(record) for name, record in self.files.items()}}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.files))

    @property
    def digests(self) -> dict[str, str]:
        """Each file's sha256 by name: what a proof of these files must name."""
        return {name: record.sha256 for name, record in self.files.items()}


@dataclass(frozen=True)
class Artifacts:
    """A checked artifacts folder: every listed file present with the listed sha256."""

    folder: Path
    manifest: Manifest

    @property
    def provenance(self) -> Provenance:
        return self.manifest.provenance

    @property
    def files(self) -> dict[str, Path]:
        return {name: self.folder / name for name in self.manifest.files}

    def place(self, dest: Path) -> None:
        """Copy the files into a folder with the modes the manifest records (artifact stores
        such as GitHub's drop permission bits); each copy is what the manifest's digest
        names (a file changed since `load` is refused, not placed)."""
        dest.mkdir(parents=True, exist_ok=True)
        for name, path in self.files.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            with open(dest / name, "wb") as copy:
                copied = copied_sha256(path, copy)
            if copied != self.manifest.files[name].sha256:
                raise Sm121Error(f"{path}: sha256 differs from the manifest; the artifacts "
                                 "were changed after they were checked")
            mode = self.manifest.files[name].mode
            (dest / name).chmod(int(mode, 8) & 0o777 if re.fullmatch(r"[0-7]{3,4}", mode)
                                else 0o755)


def export(out: Path, files: dict[str, Path], provenance: Provenance,
           counts: dict[str, tuple[dict[str, int], int]],
           sign_key: SigningKey | None = None) -> Path:
    """Copy the files to `out` and write the manifest last (a folder without one is partial).
    `counts`: per file, its cubins per arch and its kernels native on the run's GPU.  With a key,
    `manifest.json.sig` beside it: the key's signature over the manifest's exact bytes (as
    `cosign sign-blob --key` makes it), which lists every file's sha256."""
    refuse_links_below(out, out / MANIFEST)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (MANIFEST, SIGNATURE):
        if not not_regular(out / stale):
            (out / stale).unlink(missing_ok=True)
    listed: dict[str, FileRecord] = {}
    for name, path in sorted(files.items()):
        refuse_links_below(out, out / name)
        replace_file(out / name, _copier(path), path.stat().st_mode & 0o777)
        cubins, native = counts.get(name, ({}, 0))
        listed[name] = FileRecord(sha256_of(out / name), f"{path.stat().st_mode & 0o777:o}",
                                  cubins, native)
    manifest = Manifest(provenance, listed).as_json()
    written = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    replace_bytes(out / MANIFEST, written)
    if sign_key is not None:
        refuse_links_below(out, out / SIGNATURE)
        write_signature(out / MANIFEST, written, sign_key)
    return out / MANIFEST


def _copier(source: Path) -> Callable[[BinaryIO], None]:
    def copy(out: BinaryIO) -> None:
        copied_sha256(source, out)
    return copy


MAX_MANIFEST = 16 << 20


def load(folder: Path, trust: TrustKey | None = None) -> Artifacts:
    """Read and check an artifacts folder; any problem is a one-line Sm121Error.  With a
    trust key, the manifest must carry that key's signature (`manifest.json.sig`, written
    by `--out DIR --sign-key KEY`) over the very bytes read here, or the folder is refused
    (`Untrusted`, exit 3); the files are then checked against the manifest's digests."""
    require_folder(folder, "the artifacts folder")
    path = folder / MANIFEST
    if kind_of(path) != "file":
        raise Sm121Error(f"{folder}: no {MANIFEST}; export artifacts with "
                         "`sm121-build --base IMAGE --out DIR`")
    raw = read_input(path, MAX_MANIFEST, MANIFEST)
    if trust is not None:
        _require_signed(folder, raw, trust)
    try:
        manifest = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise Sm121Error(f"{path}: not valid JSON ({str(exc)[:80] or type(exc).__name__})") \
            from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise Sm121Error(f"{path}: not an sm121-build manifest of format {FORMAT}")
    absent = [key for key in _REQUIRED if not manifest.get(key)]
    if absent:
        raise Sm121Error(f"{path}: missing {', '.join(absent)}")
    _require_plain_values(path, manifest)
    files = manifest["files"]
    if not isinstance(files, dict):
        raise Sm121Error(f"{path}: files must be an object of name -> details")
    for name, entry in files.items():
        if not _FILE_NAME.match(name):
            raise Sm121Error(f"{path}: {cut(name)!r} is not a .so file name (plain, or under "
                             "vllm_flash_attn/)")
        if kind_of(folder / name) != "file":
            raise Sm121Error(f"{folder / name}: listed in the manifest but missing")
        expected = entry.get("sha256") if isinstance(entry, dict) else None
        if sha256_of(folder / name) != expected:
            raise Sm121Error(f"{folder / name}: sha256 differs from the manifest; "
                             "the artifacts were changed after export")
        if read_head(folder / name, 4, "artifact") != ELF_MAGIC:
            raise Sm121Error(f"{folder / name}: not an ELF file (a .so extension is one)")
    return Artifacts(folder, Manifest.from_json(manifest))


def _require_signed(folder: Path, manifest: bytes, trust: TrustKey) -> None:
    """The folder's manifest signed by `trust`, or `Untrusted` (exit 3) saying why."""
    if not has_signature(folder / MANIFEST):
        raise Untrusted(f"{folder}: not signed (no {SIGNATURE}; {trust.path} is trusted): "
                        "write it with `--out DIR --sign-key KEY`")
    if not signed_beside(folder / MANIFEST, manifest, trust):
        raise Untrusted(f"{folder}: {MANIFEST} is not signed by {trust.path} (changed since "
                        "it was signed, or signed by another key)")


def _is_arch_list(value: object) -> bool:
    """An arch list as `ArchList.parse` reads one (the one parser; the command line's
    separators, so a manifest written before the list was spelt one way, `12.0f,12.1`, is
    still read), with at least one entry."""
    try:
        return bool(ArchList.parse(str(value)).items)
    except Sm121Error:
        return False


def _require_plain_values(path: Path, manifest: dict[str, Any]) -> None:
    """Every provenance value is one printable line (they become labels and build arguments
    of a Dockerfile: a newline would add an instruction), the arch list an arch list."""
    external = manifest.get("external") or {}
    if not isinstance(external, dict):
        raise Sm121Error(f"{path}: external must be an object of project -> commit")
    values = {k: v for k, v in manifest.items() if k not in ("files", "format", "external")}
    values.update({f"external.{k}": v for k, v in external.items()})
    for key, value in values.items():
        if value is not None and not isinstance(value, str):
            raise Sm121Error(f"{path}: {key} must be a string, not {type(value).__name__}")
        if not str(key).isprintable() or (value and not value.isprintable()):
            raise Sm121Error(f"{path}: {cut(key)!r} holds a control character (a newline?): "
                             "refused")
    if not _is_arch_list(manifest.get("arch_list")):
        raise Sm121Error(f"{path}: arch_list {cut(str(manifest.get('arch_list')))!r} is not an "
                         f"arch list such as {DEFAULT_ARCH} or 12.0;{DEFAULT_ARCH}a")
    gpu = manifest.get("gpu")
    if gpu is not None and not re.fullmatch(r"sm_\d{2,3}", str(gpu)):
        raise Sm121Error(f"{path}: gpu {cut(str(gpu))!r} is not a GPU such as {DEFAULT_GPU} or "
                         "sm_120")
