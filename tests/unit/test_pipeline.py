"""The whole pipeline (build and inject) against the FAKE engine of devkit/fakeengine.py: no
Docker.  Everything else is real: the vLLM-shaped source in a real git repository, the guard
rules and CMake, the rendered Dockerfile (the fake carries out its final stage), the
verification reading nvcc-built .so files, the run record and its schema.  The same runs
against a real engine are tests/integration/test_e2e_docker.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from devkit.fakeengine import FakeEngine, stock_image
from devkit.stockimage import VERSION
from sm121_build.core.errors import BuildFailed, Sm121Error, VerificationError
from sm121_build.core.labels import CONTENT_KEY_LABEL
from sm121_build.core.shipped import schema
from sm121_build.cuda.compat import ArchList
from sm121_build.image.api import PIN_REPO
from sm121_build.jobs.formats.artifacts import load
from sm121_build.jobs.framework import run_record
from sm121_build.jobs.framework.pipeline import Pipeline
from sm121_build.jobs.kernel_images.injection import Destination, run_inject
from sm121_build.jobs.main_run.main_job import run_build
from sm121_build.jobs.main_run.main_plan import Options

ARCHS_121 = ArchList.parse("12.1")  # a Spark's arch list

BASE = "vllm/vllm-openai:fixture"
TAG = "vllm/vllm-openai:fixture-sm121"


pytestmark = pytest.mark.usefixtures("isolated_cache")


def _engine(tmp_path: Path, matrix: dict[str, Path], commit: str, stock: str = "sm90",
            built: str = "sm121") -> FakeEngine:
    engine = FakeEngine(tmp_path / "engine", compiled={
        name: matrix[built] for name in ("_C.abi3.so", "_moe_C.abi3.so")})
    engine.work.mkdir()
    stock_image(engine, BASE, {name: matrix[stock] for name in ("_C.abi3.so", "_moe_C.abi3.so")},
                VERSION, commit)
    return engine


def _options(source: Path, out: Path | None = None, force: bool = False,
             no_patch: bool = False) -> Options:
    return Options(base=BASE, tag=TAG, arch=ARCHS_121, extra_ext=(), jobs=2,
                   source=source,
                   repo="/nonexistent", out=out, force=force, no_patch=no_patch)


def _quick(source: Path) -> Options:
    """No guard rules and no rebuild decision (each runs CMake): for the tests of what
    happens after the build starts."""
    return _options(source, force=True, no_patch=True)


def _run(engine: FakeEngine, opts: Options) -> run_record.RunRecord:
    record = run_record.new_record("build", opts.base, opts.tag, opts.arch)
    with run_record.recorded(record, None, None):
        run_build(Pipeline(engine, record), opts)
    jsonschema.validate(record.as_json(), schema("report"))
    return record


def test_build_fills_the_record_and_tags_only_after_verification(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    stock_id = engine.tags[BASE]
    record = _run(engine, _options(checkout[0], out=tmp_path / "out"))
    assert record.status == "built"
    assert (record.vllm_version, record.vllm_commit, record.arch_list) == (
        VERSION, checkout[1], "12.1")
    assert record.extensions == ["_C.abi3.so", "_moe_C.abi3.so"]
    assert record.decision is not None and record.decision.rebuild
    assert record.before and set(record.before["_C.abi3.so"].cubins) == {"sm_90"}
    assert record.after and set(record.after["_C.abi3.so"].cubins) == {"sm_121"}
    assert record.after["_C.abi3.so"].kernels["native"] > 0
    built = engine.tags[TAG]
    assert record.image_id == built != stock_id and record.tags == [TAG]
    assert engine.images[built].info.labels[CONTENT_KEY_LABEL] == record.content_key
    # order: pin the base, build, tag, drop the pin; the stock image is left as it was
    assert [c.split()[0] for c in engine.calls] == ["pin", "build", "tag", "unpin"]
    assert not any(t.startswith(f"{PIN_REPO}/") for t in engine.tags)
    assert engine.tags[BASE] == stock_id
    site = engine.images[stock_id].root / "usr/local/lib/python3.12/dist-packages/vllm"
    assert (site / "_C.abi3.so").read_bytes() == matrix["sm90"].read_bytes()
    assert (tmp_path / "out" / "_C.abi3.so").read_bytes() == matrix["sm121"].read_bytes()
    assert record.log and Path(record.log).read_text().startswith("fake build")


def test_unchanged_inputs_skip_the_build_and_keep_the_audit(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    first = _run(engine, _options(checkout[0], no_patch=True))
    engine.calls.clear()
    engine.untag(TAG)  # the user removed the tag; the image (and its content key) remain
    engine.calls.clear()
    again = _run(engine, _options(checkout[0], no_patch=True))
    assert again.status == "up-to-date"
    assert again.content_key == first.content_key
    assert (again.before, again.after, again.log) == (first.before, first.after, first.log)
    assert engine.calls == [f"tag {TAG}"]  # no pin, no build: tagged again, nothing else
    assert engine.tags[TAG] == first.image_id
    forced = _run(engine, _options(checkout[0], force=True, no_patch=True))
    assert forced.status == "built" and any(c.startswith("build ") for c in engine.calls)


@pytest.mark.parametrize("where", ["build", "verify", "tag"])
@pytest.mark.parametrize(("how", "raised", "said"), [
    ("fail_at", BuildFailed, "docker build failed: injected failure at {where}"),
    ("interrupt_at", KeyboardInterrupt, "interrupted")])
def test_a_failure_or_ctrl_c_tags_nothing_and_removes_what_the_run_made(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str], where: str,
        how: str, raised: type[BaseException], said: str) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    before = set(engine.images)
    setattr(engine, how, where)
    record = run_record.new_record("build", BASE, TAG, ARCHS_121)
    with pytest.raises(raised), run_record.recorded(record, None, None):
        run_build(Pipeline(engine, record), _quick(checkout[0]))
    assert (record.status, record.error) == ("failed", said.format(where=where))
    assert set(engine.images) == before  # the built image (if any) was removed
    assert TAG not in engine.tags and engine.calls[-1].startswith("unpin ")
    assert not any(t.startswith(f"{PIN_REPO}/") for t in engine.tags)
    jsonschema.validate(record.as_json(), schema("report"))


def test_an_image_whose_kernels_are_lost_is_not_tagged(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1], built="sm90")  # the compile yields no 12.x
    before = set(engine.images)
    with pytest.raises(VerificationError, match="no sm_121-loadable cubin"):
        _run(engine, _quick(checkout[0]))
    assert set(engine.images) == before and TAG not in engine.tags


def test_a_stock_image_that_already_runs_natively_is_not_rebuilt(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1], stock="sm121")
    record = _run(engine, _options(checkout[0], no_patch=True))
    assert record.status == "not-needed"
    assert record.decision is not None and not record.decision.rebuild
    assert engine.calls == [] and TAG not in engine.tags


def test_inject_puts_exported_artifacts_into_a_matching_base(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    _run(engine, _options(checkout[0], out=tmp_path / "out", no_patch=True))
    record = run_record.new_record("inject", BASE, "fixture:injected", None)
    run_inject(Pipeline(engine, record), load(tmp_path / "out"), BASE,
               Destination("fixture:injected"))
    assert record.status == "injected" and record.vllm_commit == checkout[1]
    assert record.tags == ["fixture:injected"] and record.after
    jsonschema.validate(record.as_json(), schema("report"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["torch_version"] == "2.11.0+cu130"  # the base's, which the files link to
    other = stock_image(engine, "vllm/vllm-openai:other", {}, "0.20.0", "e" * 40)
    with pytest.raises(Sm121Error, match="refusing to inject"):
        run_inject(Pipeline(engine), load(tmp_path / "out"), "vllm/vllm-openai:other",
                   Destination("x:y"))
    assert other in engine.images and "x:y" not in engine.tags


def test_inject_refuses_a_base_with_another_torch_before_any_work(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """The same vLLM commit on a newer torch: the files would not load there."""
    engine = _engine(tmp_path, matrix, checkout[1])
    _run(engine, _options(checkout[0], out=tmp_path / "out", no_patch=True))
    newer = stock_image(engine, "vllm/vllm-openai:newer-torch",
                        {name: matrix["sm90"] for name in ("_C.abi3.so", "_moe_C.abi3.so")},
                        VERSION, checkout[1], torch="2.12.0+cu130")
    engine.calls.clear()
    with pytest.raises(Sm121Error) as refused:
        run_inject(Pipeline(engine), load(tmp_path / "out"), "vllm/vllm-openai:newer-torch",
                   Destination("x:y"))
    assert str(refused.value) == (
        f"artifacts in {tmp_path / 'out'} were built against torch 2.11.0+cu130; "
        "vllm/vllm-openai:newer-torch has torch 2.12.0+cu130: refusing to inject (torch's C++ "
        "ABI changes between versions: build for this image instead)")
    assert engine.calls == [] and "x:y" not in engine.tags and newer in engine.images
    manifest = tmp_path / "out" / "manifest.json"  # a manifest from before torch_version
    data = json.loads(manifest.read_text())
    del data["torch_version"]
    manifest.write_text(json.dumps(data))
    record = run_record.new_record("inject", BASE, "x:y", None)
    run_inject(Pipeline(engine, record), load(tmp_path / "out"), "vllm/vllm-openai:newer-torch",
               Destination("x:y"))
    assert record.status == "injected"  # the ABI check is the judge (the fixture needs none)


def test_resolve_image_is_the_prelude_of_every_command(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    engine = _engine(tmp_path, matrix, checkout[1])
    record = run_record.new_record("build", BASE, TAG, ARCHS_121)
    facts, vllm = Pipeline(engine, record).resolve_image(BASE)
    assert (vllm.version, vllm.extensions) == (VERSION, ("_C.abi3.so", "_moe_C.abi3.so"))
    assert (vllm.cuda_version, vllm.python) == ("13.0", "3.12")
    assert record.base_digest == facts.digest_ref == engine.tags[BASE]
    with pytest.raises(Sm121Error, match="cannot pull"):  # --pull goes to the registry
        Pipeline(engine).resolve_image(BASE, pull="always")
    with pytest.raises(Sm121Error, match="not found"):
        Pipeline(engine).resolve_image("vllm/vllm-openai:absent")


def test_plan_decides_per_extension_and_builds_nothing(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """--plan: the per-extension decision on the stock files (here sm_90 only: vLLM's own
    arch list gives 12.1), written to the record, and no engine call past the reads."""
    from dataclasses import replace

    engine = _engine(tmp_path, matrix, checkout[1])
    record = _run(engine, replace(_options(checkout[0]), plan_only=True))
    assert record.status == "planned"
    assert record.decision is not None and record.decision.chosen == (
        "_C.abi3.so", "_moe_C.abi3.so")
    c = record.decision.extensions["_C.abi3.so"]
    assert c["build"] and c["reason"] == (
        "the main arch list (CUDA_ARCHS) gives 12.1; FP4_ARCHS (CMakeLists.txt:16) gives 12.1a"
        ", which the stock file has no cubins for")
    assert c["before"]["native"] == 0 and c["after"]["none"] == 0
    assert engine.calls == [] and TAG not in engine.tags


def test_only_restricts_the_plan(tmp_path: Path, matrix: dict[str, Path],
                                 checkout: tuple[Path, str]) -> None:
    from dataclasses import replace

    engine = _engine(tmp_path, matrix, checkout[1])
    record = _run(engine, replace(_options(checkout[0]), plan_only=True, only=("_moe_C",)))
    assert record.decision is not None and record.decision.chosen == ("_moe_C.abi3.so",)


def test_inject_refuses_a_file_at_a_path_where_the_base_has_no_extension(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """`vllm/_version.abi3.so` would be imported before `_version.py`: any extra module in
    the package runs its code at `import vllm`.  Only the base's own extension files are
    replaced; the rest is refused before the engine builds anything."""
    from sm121_build.core.inputs import sha256_of

    engine = _engine(tmp_path, matrix, checkout[1])
    _run(engine, _options(checkout[0], out=tmp_path / "out", no_patch=True))
    for name in ("_version.abi3.so", "vllm_flash_attn/__init__.abi3.so"):
        folder = tmp_path / name.replace("/", "-")
        shutil.copytree(tmp_path / "out", folder)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / "_C.abi3.so", folder / name)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"][name] = {**manifest["files"]["_C.abi3.so"],
                                   "sha256": sha256_of(folder / name)}
        (folder / "manifest.json").write_text(json.dumps(manifest))
        engine.calls.clear()
        with pytest.raises(Sm121Error, match=rf"would place {re.escape(name)}, which {BASE} "
                                             "has no extension file at"):
            run_inject(Pipeline(engine), load(folder), BASE, Destination("x:extra"))
        assert engine.calls == [] and "x:extra" not in engine.tags


def test_an_injected_file_gets_the_stock_files_mode(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """Whatever mode the artifacts record (here 777), the placed file has the stock file's
    (and verification would refuse any other: tests/unit/test_host_code.py)."""
    engine = _engine(tmp_path, matrix, checkout[1])
    _run(engine, _options(checkout[0], out=tmp_path / "out", no_patch=True))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["files"]["_C.abi3.so"]["mode"] = "777"  # placed with the mode it records
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    record = run_record.new_record("inject", BASE, "x:mode", None)
    run_inject(Pipeline(engine, record), load(tmp_path / "out"), BASE, Destination("x:mode"))
    stock = engine.images[engine._id(BASE) or ""].root
    placed = engine.images[engine._id("x:mode") or ""].root
    package = next(stock.rglob("_C.abi3.so")).relative_to(stock)
    assert (placed / package).stat().st_mode & 0o7777 == \
        (stock / package).stat().st_mode & 0o7777 != 0o777


def test_out_never_writes_through_a_link_already_in_it(
        tmp_path: Path, matrix: dict[str, Path], checkout: tuple[Path, str]) -> None:
    """--out DIR holding a link named like a file it exports (or the manifest) that leads
    out of it: one line, nothing tagged, the file the link names untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("_C.abi3.so", "manifest.json"):
        (tmp_path / name).mkdir()
        engine = _engine(tmp_path / name, matrix, checkout[1])
        out = tmp_path / name / "out"
        out.mkdir()
        (out / name).symlink_to(victim)
        with pytest.raises(Sm121Error, match=r"a symlink: not written over"):
            _run(engine, _options(checkout[0], out=out, no_patch=True))
        assert victim.read_text() == "keep me" and TAG not in engine.tags


@pytest.mark.parametrize(("changes", "checked"), [
    ({}, False),  # the default run: aot may do it all; the compiler is checked if it builds
    ({"only": ("_vllm_fa2_C",)}, False),
    ({"aot_only": True}, False),
    ({"source": Path("/src")}, True),  # a source given: a build is certain
    ({"from_source": True}, True),
    ({"force": True}, True),
    ({"no_patch": True}, True),
    ({"aot_only": True, "source": Path("/src")}, False),  # `aot IMAGE` never builds
])
def test_the_image_compiler_is_checked_up_front_only_when_a_build_is_certain(
        changes: dict[str, object], checked: bool) -> None:
    from dataclasses import replace

    from sm121_build.jobs.main_run.main_plan import builds_for_sure

    opts = replace(_options(Path("/unused")), source=None)
    assert builds_for_sure(replace(opts, **changes)) is checked  # type: ignore[arg-type]


def _assigned_on_a_pipeline(source: str) -> list[str]:
    """Each `pipeline.X = ...` (or `run.pipeline.X`, augmented, annotated) in `source`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for one in (target.elts if isinstance(target, ast.Tuple) else [target]):
                owner = one.value if isinstance(one, ast.Attribute) else None
                name = owner.id if isinstance(owner, ast.Name) else \
                    owner.attr if isinstance(owner, ast.Attribute) else ""
                if name == "pipeline":
                    found.append(f"{name}.{one.attr}")  # type: ignore[union-attr]
    return found


def test_a_pipeline_is_made_with_its_gpu_and_keys_and_never_changed(tmp_path: Path) -> None:
    """#61: the GPU a run serves and its keys are given to its Pipeline when it is made
    (run_session, from Serving), never set on it after: no code assigns an attribute of a
    pipeline (the scan finds a planted one), and the three cannot be assigned at all."""
    from sm121_build.cuda.binary import gpu_policy
    from sm121_build.jobs.framework.pipeline import Keys

    planted = "def f(pipeline, run):\n    pipeline.gpu = 1\n    run.pipeline.trust_key, x = 2, 3\n"
    assert _assigned_on_a_pipeline(planted) == ["pipeline.gpu", "pipeline.trust_key"]
    package = Path(__file__).resolve().parents[2] / "sm121_build"
    assigned = {str(path.relative_to(package)): found for path in sorted(package.rglob("*.py"))
                if (found := _assigned_on_a_pipeline(path.read_text()))}
    assert assigned == {}
    other = gpu_policy("sm_90")
    pipeline = Pipeline(FakeEngine(tmp_path), gpu=other, keys=Keys())
    assert pipeline.gpu is other and pipeline.sign_key is None and pipeline.trust_key is None
    for name in ("gpu", "sign_key", "trust_key"):
        with pytest.raises(AttributeError):
            setattr(pipeline, name, None)
