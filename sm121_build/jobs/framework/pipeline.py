"""The pipeline object every image command runs through.

`Pipeline` owns the engine (anything that implements `image.api.ImageEngine`: Docker, or a
folder-backed stand-in in the unit tests), the steps log and the run record.  Its prelude,
`resolve_image` (pull when asked -> inspect -> require vLLM), is what `build`, `inject`,
`pin` and `dockerfile` all start with; its tail, `build_verify_tag` (build untagged -> verify
-> export -> tag), is what `build` and `inject` end with.  Nothing is tagged before verification
passes; on any failure, Ctrl-C included, an image this run created is removed (never one that
existed before it, such as a build-cache hit the user has tagged).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sm121_build.audit.unpack import binaries
from sm121_build.core.compile_progress import shipped_histories
from sm121_build.core.console import (
    BuildStatus,
    LiveLine,
    Progress,
    Steps,
    end_status_line,
    note,
    result,
)
from sm121_build.core.errors import Sm121Error
from sm121_build.core.interrupts import held, temp_dir
from sm121_build.core.labels import CONTENT_KEY_LABEL
from sm121_build.core.paths import new_state_file
from sm121_build.cuda.binary import DEFAULT_POLICY, BinaryReport, Policy, audit_binary
from sm121_build.image import ledger
from sm121_build.image.api import ImageEngine
from sm121_build.image.cosign import SigningKey, TrustKey
from sm121_build.image.facts import ImageFacts, VllmInstall, inspect_image, require_vllm
from sm121_build.jobs.formats import artifacts as artifacts_mod
from sm121_build.jobs.framework import run_record
from sm121_build.jobs.framework.run_warnings import age_warning
from sm121_build.verify.checks import (
    Candidate,
    Origin,
    StockRead,
    Verified,
    read_stock_side,
    verify_image,
)


@dataclass(frozen=True)
class ImageBuild:
    """One image to build from a rendered Dockerfile: the base it starts from, the context
    and its Dockerfile, the files it places (what verification compares with the base's),
    the log and the step's title."""

    stock: ImageFacts
    context: Path
    dockerfile: Path
    extensions: tuple[str, ...]
    log: Path
    title: str


@dataclass(frozen=True)
class Delivery:
    """Where a verified image goes: its tags, and the artifacts folder with what its
    manifest says the files were built from."""

    tag: str
    out: Path | None
    provenance: artifacts_mod.Provenance
    also: tuple[str, ...] = ()  # more tags for the same image (e.g. the immutable one)
    replace_tag: bool = False  # --replace-tag: a tag may move off an image we did not build
    content_key: str = ""  # written in the ledger with the image
    origins: tuple[tuple[str, Origin], ...] = ()  # files not built here: where they come from

    @property
    def tags(self) -> list[str]:
        return list(dict.fromkeys((self.tag, *self.also)))


def say_tagged(delivery: Delivery, log: Path) -> None:
    """The one line a run that tagged its verified image ends with (build, aot, inject)."""
    result(f"tagged {', '.join(delivery.tags)}  (log: {log})")


def manifest_counts(verified: Verified) -> dict[str, tuple[dict[str, int], int]]:
    """What the manifest says of each file besides its hash and mode."""
    return {name: (report.arch_counts("elf"), report.kernel_counts()["native"])
            for name, report in verified.reports.items()}


@dataclass(frozen=True)
class Keys:
    """A run's keys for kernels images: the one `--kernels-to` signs with (`sign`), the one
    a found image must be signed by (`trust`)."""

    sign: SigningKey | None = None
    trust: TrustKey | None = None


class Pipeline:
    """One run: an engine, its steps log and its record (None for commands that report
    nothing, such as `pin`), the GPU it serves (`--gpu`: audits and verification) and its
    keys, all given when it is made and never changed after."""

    def __init__(self, engine: ImageEngine, record: run_record.RunRecord | None = None,
                 steps: Steps | None = None, gpu: Policy = DEFAULT_POLICY,
                 keys: Keys = Keys()) -> None:
        self.engine = engine
        self.record = record if record is not None else run_record.RunRecord("", "", "", None)
        self.steps = steps or Steps()
        self._gpu = gpu
        self._keys = keys
        self._resolved: dict[str, tuple[ImageFacts, VllmInstall]] = {}

    @property
    def gpu(self) -> Policy:
        """The GPU the run serves."""
        return self._gpu

    @property
    def sign_key(self) -> SigningKey | None:
        """The key `--kernels-to` signs with (None: unsigned)."""
        return self._keys.sign

    @property
    def trust_key(self) -> TrustKey | None:
        """The key a kernels image found must be signed by (None: no signature asked)."""
        return self._keys.trust

    @classmethod
    def connect(cls, record: run_record.RunRecord | None = None,
                steps: Steps | None = None, gpu: Policy = DEFAULT_POLICY,
                keys: Keys = Keys()) -> Pipeline:
        """A pipeline on the local Docker engine (the SDK is imported only here)."""
        from sm121_build.image.engine import Engine

        return cls(Engine.connect(), record, steps, gpu, keys)

    # -- prelude -------------------------------------------------------------------------
    def resolve_image(self, ref: str, pull: str = "never") -> tuple[ImageFacts, VllmInstall]:
        """`--pull` (always) or `--pull=missing` first, then the image's facts and its vLLM
        (an error when it has none).  Once per run: a reference this run resolved already,
        still naming the same image and not to be pulled, is not inspected again (a
        `--kernels-from` lookup, then the inject or the build it hands over to)."""
        known = self._resolved.get(ref)
        if known and pull == "never" and self.engine.image_id(ref) == known[0].id:
            return known
        self.pull(ref, pull)
        with self.steps.step(f"inspect {ref}"):
            facts = inspect_image(self.engine, ref)
            vllm = require_vllm(facts)
            self.record.base_inspected(vllm.version, facts.digest_ref)
            note(f"vLLM {vllm.version}; {facts.platform}; {facts.digest_ref}")
            if vllm.tools:
                note(f"build tools: {vllm.tools.describe()}")
            stale = age_warning(ref, facts.created)
            if stale:
                note(stale)
        self._resolved[ref] = (facts, vllm)
        return facts, vllm

    def pull(self, ref: str, mode: str) -> None:
        """Bring `ref` from its registry (`always`, or `missing` when it is not here).  A tag
        that moved leaves the old image behind; the ledger notes it for `sm121-build prune`."""
        if mode == "never" or (mode == "missing" and self.engine.exists(ref)):
            return
        with self.steps.step(f"pull {ref}"):
            before = self.engine.image_id(ref)
            live = LiveLine()
            after = self.engine.pull(ref, live)
            end_status_line()
            if live.last.startswith("pulled "):
                note(live.last)
            self.record.base_pulled(run_record.Pulled(before, after))
            short = after.split(":")[-1][:12]
            if before is None:
                line = f"new image {short}"
            elif before == after:
                line = f"unchanged, {short}"
            else:
                ledger.record_replaced(ref, before)
                line = f"new image {short} (was {before.split(':')[-1][:12]})"
            note(f"{ref}: {line}")

    def read_stock(self, facts: ImageFacts,
                   extensions: tuple[str, ...]) -> dict[str, BinaryReport | None]:
        """The stock image's copies of the extensions a build would replace, audited."""
        package = require_vllm(facts).package_dir
        reports: dict[str, BinaryReport | None] = {}
        progress = Progress("reading the stock extensions")
        with temp_dir("sm121-decide-") as tmp, \
                self.engine.reader(facts.id, progress.add) as files:
            for name in extensions:
                local = Path(tmp) / name
                local.parent.mkdir(parents=True, exist_ok=True)
                found = files.copy_file(f"{package}/{name}", local)
                reports[name] = audit_binary(local, name, self.gpu, with_kernels=True) if found \
                    else None
                local.unlink(missing_ok=True)
        progress.done()
        return reports

    def read_device_files(self, facts: ImageFacts) -> dict[str, BinaryReport | None]:
        """Every file of the image that carries device code, audited, named by its path from
        `/` (`aot IMAGE --all-packages`): the image is streamed as the audit streams it,
        never exported, and only files with device code are kept on disk."""
        reports: dict[str, BinaryReport | None] = {}
        with binaries(facts.id, engine=lambda: self.engine) as found:  # every file
            for binary in found:
                if binary.skipped is None and binary.host_only_size is None:
                    name = binary.name.lstrip("/")
                    reports[name] = audit_binary(binary.path, name, self.gpu,
                                                 with_kernels=True)
        return reports

    def new_log(self, name: str, recorded: bool = True) -> Path:
        """An empty build log under the state folder, named in the record (the run's build
        log) unless `recorded` is false."""
        # one file per run: two runs of one content key never write into each other's log
        log = new_state_file("logs", name, ".log")
        if recorded:
            self.record.log_opened(log)
        return log

    # -- tail ----------------------------------------------------------------------------
    def build_verify_tag(self, build: ImageBuild, delivery: Delivery) -> str:
        """Build (untagged) -> verify -> export -> tag.  Returns the image ID.  What
        verification reads of the base (the stock files, torch's exports) depends on the
        base alone: it is read while the candidate builds, by one thread of its own."""
        image_id = ""
        before = self.engine.image_ids()
        with temp_dir("sm121-stock-side-") as ahead_dir:
            pool = ThreadPoolExecutor(1)
            try:
                with held():  # a Ctrl-C inside submit() would leave a thread unwaited for
                    ahead = pool.submit(read_stock_side, self.engine, build.stock,
                                        (build.extensions, delivery.provenance.package_dir),
                                        Path(ahead_dir), self.gpu)
                with self.steps.step(build.title), BuildStatus(shipped_histories()) as status:
                    image_id = self.engine.build(build.context, build.dockerfile, build.log,
                                                 status)
                with self.steps.step("verify"):
                    self.verify_and_export(build.stock, image_id, build.extensions,
                                           (build.log, ahead.result()), delivery)
                self.tag_result(build.stock, image_id, delivery)
            except BaseException:
                if image_id:
                    self.engine.remove_created(image_id, before)
                raise
            finally:  # the read-ahead is done or dropped before its folder is removed
                with held():
                    pool.shutdown(wait=True, cancel_futures=True)
        return image_id

    def verify_and_export(self, stock: ImageFacts, image_id: str,
                          extensions: tuple[str, ...],
                          log_and_stock: tuple[Path | None, StockRead | None],
                          delivery: Delivery) -> None:
        """Verify the image (raises on any problem); record the audit; export to `--out`.
        `log_and_stock`: where problems are written, and the base's side when it was read
        ahead (`read_stock_side`; None: read now)."""
        log, stock_read = log_and_stock
        with verify_image(self.engine, Candidate(stock, image_id, extensions, log,
                                                 dict(delivery.origins),
                                                 delivery.provenance.package_dir,
                                                 stock_read, self.gpu)) as verified:
            self.record.verified(
                verified.stock_reports, verified.reports,
                {n: len(c.fp4_excluded) for n, c in verified.comparisons.items()},
                verified.abi.checked)
            if delivery.out:
                manifest = artifacts_mod.export(delivery.out, verified.files, delivery.provenance,
                                                manifest_counts(verified), self.sign_key)
                self.record.exported(delivery.out)
                note(f"artifacts: {manifest}")

    def require_tags_free(self, stock: ImageFacts, tags: list[str],
                          replace_tag: bool = False, image_id: str = "") -> None:
        """A tag may name nothing yet, the image about to get it, or an image this tool
        built from the same base (a rebuild moving its own tag); never the base itself, and
        a user's image only with --replace-tag.  Checked before any work and again just
        before tagging."""
        require_tags_free(self.engine, tags, TagRule(
            replace_tag, image_id, stock.id,
            lambda entry: entry.base_ref in ("", stock.ref), ""))

    def tag_result(self, stock: ImageFacts, image_id: str, delivery: Delivery) -> None:
        """Give the verified image every tag asked for, and write it in the ledger."""
        self.require_tags_free(stock, delivery.tags, delivery.replace_tag, image_id)
        ledger.record_built(image_id, delivery.tags, stock.id, stock.ref, delivery.content_key)
        for tag in delivery.tags:
            self.engine.tag(image_id, tag)
        self.record.tagged(image_id, delivery.tags)

    def reusable(self, key: str) -> str | None:
        """An image this tool built and recorded for this content key, still in the engine.
        Labels are inherited, so an image a user built FROM an earlier result carries the
        same key: only the ledger tells ours apart."""
        book = ledger.load()
        for info in self.engine.find_by_label(CONTENT_KEY_LABEL, key):
            entry = book.entry(info.id)
            if entry and entry.content_key == key:
                return info.id
        return None


@dataclass(frozen=True)
class TagRule:
    """When a tag may be given: what `--replace-tag` said, the image about to get it, a
    base that may never lose its tag, which of this tool's own images may give up theirs
    (an entry of the ledger), and what to call the holder's kind in a refusal."""

    replace_tag: bool
    image_id: str
    base_id: str | None
    ours: Callable[[ledger.Built], bool]
    what: str


def require_tags_free(engine: ImageEngine, tags: list[str], rule: TagRule) -> None:
    """The one tag rule of every command that tags (the main job, aot IMAGE, inject, kernels
    publish, --kernels-to): a tag may name nothing yet, the image about to get it, or an
    image this tool gave that tag to that the rule calls its own; never the base itself,
    and any other image only with --replace-tag (the image itself stays)."""
    book = ledger.load()
    for tag in tags:
        holder = engine.image_id(tag)
        if holder is None or holder == rule.image_id:
            continue
        short = holder.split(":")[-1][:12]
        if holder == rule.base_id:
            raise Sm121Error(f"--tag {tag} names the base image itself ({short}): choose "
                             "another --tag (the base's own tag is never moved)")
        entry = book.entry(holder)
        if entry and tag in entry.tags and rule.ours(entry):
            continue
        why = (f"sm121-build built it from {entry.base_ref}" if entry and entry.base_ref
               else "sm121-build did not give it that tag" if entry
               else "sm121-build did not build it")
        if rule.replace_tag:
            note(f"--replace-tag: {tag} moves off image {short} ({why}); that image stays")
            continue
        raise Sm121Error(f"{rule.what or '--tag'} {tag} already names image {short} ({why}): "
                         "choose another --tag, or --replace-tag to move it (the image itself "
                         "stays)")
