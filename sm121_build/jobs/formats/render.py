"""Render the multi-stage Dockerfile from the templates in dockerfiles/ (string.Template data)."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from sm121_build import __version__
from sm121_build.core.console import cut
from sm121_build.core.errors import Sm121Error
from sm121_build.core.labels import FIELD_LABELS, LABEL_PREFIX
from sm121_build.core.shipped import shipped_dir
from sm121_build.core.vllm import DEFAULT_EXTENSIONS, MIN_CMAKE, extension_target, project_of_target
from sm121_build.cuda.compat import DEFAULT_GPU, ArchList
from sm121_build.image.build_tools import TOOLS_PREFIX, how_to_bring
from sm121_build.image.facts import ImageFacts, plain_path, require_vllm
from sm121_build.source.external import stand_in_envs
from sm121_build.source.guard_rules import rules_digest


@dataclass(frozen=True)
class Placement:
    """What places files into the pristine base (every rendered image ends so): the base,
    what the files are (labels and the Dockerfile's header say it), and where they go."""

    base: str
    arch_list: str
    vllm_version: str
    git_ref: str
    extensions: tuple[str, ...]
    package_dir: str
    labels: dict[str, str] = field(default_factory=dict)
    prebuilt: tuple[str, ...] = ()  # files made before the build (aot), in the context's aot/

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(extension_target(e) for e in self.extensions)


@dataclass(frozen=True, kw_only=True)
class BuildLayout(Placement):
    """A placement whose files a builder stage FROM the base compiles first: the toolchain
    and what the builder is handed; all of it derived from the image and the source."""

    cuda_home: str
    cuda_include: str
    cuda_lib: str
    jobs: int
    nvcc_threads: int = 2
    nvrtc_fix: bool = False
    buildkit: bool = True
    bring: tuple[str, ...] = ()  # build tools the image lacks: cmake, ninja
    bring_from: str = ""  # "context" (this machine's copies) or "pip" (in the builder)
    # external project sources in the context: (environment variable, context folder)
    external: tuple[tuple[str, str], ...] = ()


def templates_dir() -> Path:
    return shipped_dir("dockerfiles")


def _template(name: str) -> Template:
    return Template((templates_dir() / name).read_text())


def template_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(templates_dir().glob("*.in")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def default_file(target: str) -> str:
    project = project_of_target(target)
    return f"{project.install_dir}/{target}.abi3.so" if project else f"{target}.abi3.so"


def choose_extensions(image_extensions: tuple[str, ...], extra: tuple[str, ...],
                      defined: Collection[str] | None,
                      defaults: bool = True) -> tuple[str, ...]:
    """The default set (the image's _C/_moe_C files, unless `defaults` is False: the main
    job's decision names every one) plus `extra`, checked against the CMake targets the
    source defines (`source_targets`; None: no source read).  A name is a CMake target or a
    file name; the image's own path for it wins."""
    chosen = [e for e in image_extensions if DEFAULT_EXTENSIONS.match(e)] if defaults else []
    for name in extra:
        target = extension_target(name)
        filename = next((e for e in image_extensions if e == name or e.endswith("/" + name)
                         or (not name.endswith(".so") and extension_target(e) == target)),
                        name if name.endswith(".so") and project_of_target(target) is None
                        else default_file(target))
        if filename not in chosen:
            chosen.append(filename)
    if not chosen:
        raise Sm121Error("no _C / _moe_C extension files to rebuild (neither the image's vLLM "
                         "nor the source has them); name the ones to rebuild with --ext")
    if defined is not None:
        missing = [e for e in chosen if extension_target(e) not in defined]
        if missing:
            raise Sm121Error(f"the pinned source defines no CMake target for {', '.join(missing)}"
                             f" (it defines: {', '.join(sorted(defined)) or 'none'})")
    return tuple(chosen)


def default_jobs() -> int:
    """One compile job per core, at most one per 8 GiB of memory (nvcc peaks high)."""
    cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return max(1, cores // 2)
    return max(1, min(cores, memory // (8 << 30)))


def _quote(value: str) -> str:
    return json.dumps(value)


def _copy_lines(layout: Placement, copy_from: str, flat: bool) -> str:
    """One COPY per extension to its place in the package; the builder's out folder is flat
    (`flat`), an artifacts folder keeps the package's sub-folders; the prebuilt (aot'd)
    files come from the context's aot/."""
    copies = [(copy_from, extension.rsplit("/", 1)[-1] if flat else extension, extension)
              for extension in layout.extensions]
    copies += [("aot", extension, extension) for extension in layout.prebuilt]
    for _source, _built, extension in copies:  # the last gate before a Dockerfile's words
        _require_plain(posixpath.join(layout.package_dir, extension))
    return "\n".join(
        _template("copy-extension.Dockerfile.in").substitute(
            copy_from=source, built=built, dest=posixpath.join(layout.package_dir, extension))
        .strip() for source, built, extension in copies)


def _require_plain(path: str) -> None:
    """Refuse, in one line, a path from outside (an image's site directory, its CUDA home)
    that is not a plain absolute path (`facts.plain_path`), before any Dockerfile holds it."""
    if not plain_path(path):
        raise Sm121Error(f"{cut(path, 120)!r} is not a plain absolute path: it is never "
                         "written into a Dockerfile")


def _external(layout: BuildLayout) -> str:
    if not layout.external:
        return "# (no external project sources: vLLM's CMake gets empty stand-ins for them)"
    lines = [f"COPY {folder}/ /sm121/{folder}/" for _, folder in layout.external]
    lines.append("ENV " + " \\\n    ".join(f"{env}=/sm121/{folder}"
                                            for env, folder in layout.external))
    return "\n".join(lines)


def _label_lines(labels: dict[str, str]) -> str:
    """`"key"="value"` pairs for one LABEL instruction, JSON-quoted, one per line."""
    return " \\\n      ".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(labels.items()))


def _labels(layout: Placement, more: dict[str, str] | None = None) -> str:
    return _label_lines({**layout.labels, **(more or {})}) or \
        f'"{LABEL_PREFIX}.tool"="sm121-build"'


def _no_syntax_directive(text: str) -> str:
    if re.search(r"^#\s*syntax\s*=", text, re.M | re.I):
        raise Sm121Error("a template carries a syntax directive; it would pull an image")
    return text


def _toolchain(layout: BuildLayout) -> str:
    if not layout.bring:
        return "# (cmake and ninja: the image's own)"
    packages = " ".join(_quote(f"cmake>={MIN_CMAKE[0]}.{MIN_CMAKE[1]}") if name == "cmake"
                        else name for name in layout.bring)
    name = "tools-context.Dockerfile.in" if layout.bring_from == "context" else \
        "tools-pip.Dockerfile.in"
    return _template(name).substitute(tools=" and ".join(layout.bring), prefix=TOOLS_PREFIX,
                                      packages=packages).strip()


def render_build(layout: BuildLayout, labels: dict[str, str] | None = None,
                 base: str | None = None) -> str:
    """The multi-stage build: compile in a builder FROM the base, copy into the pristine base;
    `labels` are added to the layout's (the content key, known once the layout is), `base`
    replaces its FROM reference (the run's temporary tag for exactly that image)."""
    nvrtc = (_template("nvrtc-fix.Dockerfile.in").substitute(cuda_lib=layout.cuda_lib).strip()
             if layout.nvrtc_fix else "# (libnvrtc.so present: no link fix needed)")
    cache = ("--mount=type=cache,target=/root/.cache/ccache " if layout.buildkit else "")
    text = _template("build.Dockerfile.in").substitute(
        tool_version=__version__,
        base=base or layout.base,
        arch_list=layout.arch_list,
        vllm_version=layout.vllm_version,
        git_ref=layout.git_ref,
        extensions=", ".join(layout.extensions),
        cuda_home=layout.cuda_home,
        cpath=layout.cuda_include,
        library_path=layout.cuda_lib,
        jobs=layout.jobs,
        nvcc_threads=layout.nvcc_threads,
        nvrtc_fix=nvrtc,
        toolchain=_toolchain(layout),
        cache_mount=cache,
        target_args=" ".join([*(f"--target {t}" for t in layout.targets),
                              *(f"--stand-in {env}" for env in
                                stand_in_envs(env for env, _ in layout.external))]),
        external_sources=_external(layout),
        copy_lines=_copy_lines(layout, "--from=builder /sm121/out", flat=True),
        labels=_labels(layout, labels),
    )
    return _no_syntax_directive(text)


def render_inject(layout: Placement, artifacts: str = "artifacts",
                  more: dict[str, str] | None = None) -> str:
    """One stage: prebuilt files from the context folder `artifacts` into the pristine base
    (`more` labels beside the layout's)."""
    return _no_syntax_directive(_template("inject-artifacts.Dockerfile.in").substitute(
        tool_version=__version__, base=layout.base, arch_list=layout.arch_list,
        vllm_version=layout.vllm_version, git_ref=layout.git_ref,
        extensions=", ".join(layout.extensions),
        copy_lines=_copy_lines(layout, artifacts, flat=False), labels=_labels(layout, more)))


def render_kernels(labels: dict[str, str], root: str = "root") -> str:
    """A kernels image: the context folder `root` (the files at their paths in the base and
    the manifest) into an empty image, with its labels."""
    return _no_syntax_directive(_template("kernels.Dockerfile.in").substitute(
        tool_version=__version__, root=root, labels=_label_lines(labels)))


def provenance_labels(facts: ImageFacts, commit: str, arch: ArchList,
                      extensions: tuple[str, ...], patches: str) -> dict[str, str]:
    """OCI labels saying what the image was made from, and by what."""
    vllm = require_vllm(facts)
    values = {"base": facts.ref, "base_digest": facts.digest_ref,
              "vllm_version": vllm.version, "vllm_commit": commit, "patches": patches,
              "arch_list": arch.torch, "extensions": ",".join(extensions),
              "tool_version": __version__}
    return {FIELD_LABELS[field]: value for field, value in values.items()}


def gpu_label(gpu: str) -> dict[str, str]:
    """The label naming the GPU an image's placed files are native on (`sm_121`)."""
    return {FIELD_LABELS["gpu"]: gpu}


def aot_label(files: tuple[str, ...]) -> dict[str, str]:
    """The label naming the files aot made that a source build's image also places (none:
    no label)."""
    return {FIELD_LABELS["aot"]: ",".join(files)} if files else {}


@dataclass(frozen=True)
class LayoutRequest:
    """What a build layout is asked for, beside the image: the arch list (torch's form), the
    extensions asked for (`extra_ext`; with `defaults`, the default ones too), MAX_JOBS,
    the CMake targets the source defines (None: no source read), the git ref and commit
    the labels name, whether BuildKit builds it, whether cmake/ninja the image lacks may
    come from this machine (`copy_tools`), the external projects' trees in the context, and
    the rules digest the labels name (None: the rules shipped)."""

    arch: ArchList
    extra_ext: tuple[str, ...]
    git_ref: str
    buildkit: bool
    jobs: int | None = None
    targets: frozenset[str] | None = None
    commit: str | None = None
    copy_tools: bool = True
    defaults: bool = True
    external: tuple[tuple[str, str], ...] = ()
    patches: str | None = None


def layout_for(facts: ImageFacts, asked: LayoutRequest) -> BuildLayout:
    """A build layout from what the image says (paths are detected, never hard-coded), whole.
    The caller has checked that the image can build (`toolchain.require_buildable`)."""
    arch, jobs, copy_tools = asked.arch, asked.jobs, asked.copy_tools
    external, patches = asked.external, asked.patches
    vllm = require_vllm(facts)
    if not vllm.cuda_home:
        raise Sm121Error(f"image {facts.ref} has no nvcc under /usr/local/cuda*: the builder "
                         "stage needs the CUDA toolkit of a -devel style image")
    include = vllm.cuda_include or f"{vllm.cuda_home}/include"
    lib = vllm.cuda_lib or f"{vllm.cuda_home}/lib64"
    for path in (vllm.cuda_home, include, lib):  # each becomes words of the builder's ENV
        _require_plain(path)
    extensions = choose_extensions(vllm.extensions, asked.extra_ext, asked.targets,
                                   asked.defaults)
    labels = provenance_labels(facts, asked.commit or asked.git_ref, arch, extensions,
                               rules_digest() if patches is None else patches) \
        | gpu_label(DEFAULT_GPU)  # a source build is for the Spark alone
    return BuildLayout(
        base=facts.digest_ref, arch_list=arch.torch, external=external,
        vllm_version=vllm.version, git_ref=asked.git_ref,
        extensions=extensions, package_dir=vllm.package_dir, cuda_home=vllm.cuda_home,
        cuda_include=include, cuda_lib=lib, jobs=jobs or default_jobs(),
        nvrtc_fix=vllm.nvrtc_needs_link, buildkit=asked.buildkit, labels=labels,
        bring=vllm.tools.to_bring if vllm.tools else (),
        bring_from=(how_to_bring(vllm.tools, facts.platform) if copy_tools else "pip")
        if vllm.tools and vllm.tools.to_bring else "")
