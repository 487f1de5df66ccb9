"""The content key: every input of a build changes it, an unrelated one does not."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from sm121_build.image.facts import ImageFacts
from sm121_build.jobs.formats.render import BuildLayout, template_digest
from sm121_build.jobs.main_run import main_job as build
from sm121_build.jobs.main_run.main_job import content_key
from sm121_build.source.guard_rules import rules_digest

RULES, TEMPLATES = rules_digest(), template_digest()  # what a run gathers (gather_for_build)

FACTS = ImageFacts("vllm/vllm-openai:nightly", "sha256:" + "a" * 64,
                   "vllm/vllm-openai@sha256:" + "f" * 64, "linux/arm64")
PLAN = BuildLayout(base="pin", arch_list="12.1", vllm_version="0.19.1", git_ref="v0.19.1",
                 extensions=("_C.abi3.so", "_moe_C.abi3.so"),
                 package_dir="/usr/local/lib/python3.12/dist-packages/vllm",
                 cuda_home="/usr/local/cuda", cuda_include="/inc", cuda_lib="/lib", jobs=4)
COMMIT = "c" * 40
# sha256 of the NUL-joined inputs (base ID, commit, rules, arch list, templates, extensions,
# tool version), first 24 hex digits; "nopatch" in place of the rules with --no-patch
GOLDEN_KEY = "227b8b907c858ebb40e314a1"
GOLDEN_KEY_NO_PATCH = "5717cd1ae39b156542560374"


def test_each_input_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = content_key(FACTS, (COMMIT,), PLAN, RULES, TEMPLATES)
    changed = {
        "base image": content_key(replace(FACTS, id="sha256:" + "b" * 64), (COMMIT,), PLAN,
                                  RULES, TEMPLATES),
        "commit": content_key(FACTS, ("d" * 40,), PLAN, RULES, TEMPLATES),
        "source changes": content_key(FACTS, (f"{COMMIT}+{'e' * 64}",), PLAN, RULES,
                                      TEMPLATES),
        "arch list": content_key(FACTS, (COMMIT,), replace(PLAN, arch_list="12.1a"),
                               RULES, TEMPLATES),
        "extensions": content_key(FACTS, (COMMIT,), replace(PLAN, extensions=("_C.abi3.so",)),
                                  RULES, TEMPLATES),
        "--no-patch": content_key(FACTS, (COMMIT,), PLAN, "nopatch", TEMPLATES),
    }
    changed["guard rules"] = content_key(FACTS, (COMMIT,), PLAN, "another-rule-set", TEMPLATES)
    changed["templates"] = content_key(FACTS, (COMMIT,), PLAN, RULES, "other-templates")
    monkeypatch.setattr(build, "__version__", "99.0")
    changed["tool version"] = content_key(FACTS, (COMMIT,), PLAN, RULES, TEMPLATES)
    monkeypatch.undo()
    assert [name for name, other in changed.items() if other == key] == []
    assert len(set(changed.values())) == len(changed)


def test_unrelated_inputs_keep_the_key() -> None:
    key = content_key(FACTS, (COMMIT,), PLAN, RULES, TEMPLATES)
    assert content_key(replace(FACTS, ref="my/alias:1"), (COMMIT,), PLAN, RULES,
                       TEMPLATES) == key
    assert content_key(FACTS, (COMMIT,), replace(PLAN, jobs=16, base="other-pin"),
                       RULES, TEMPLATES) == key
    assert content_key(FACTS, (COMMIT,), PLAN, RULES, TEMPLATES) == key  # deterministic


def test_the_key_format_is_stable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key names images users already have (their content-key label) and the kept audit;
    a change of its format silently turns every later run into a rebuild.  Pinned here, for
    fixed rule, template and tool digests; change it only on purpose."""
    monkeypatch.setattr(build, "__version__", "1.0")
    key = content_key(FACTS, (COMMIT,), PLAN, "rules", "templates")
    assert len(key) == 24 and int(key, 16) >= 0
    assert key == GOLDEN_KEY
    assert content_key(FACTS, (COMMIT,), PLAN, "nopatch", "templates") == GOLDEN_KEY_NO_PATCH
    # a build with an external tree (and aot): its parts follow vLLM's, hashed as when the
    # provenance travelled as one string joined by NUL
    fa2 = "flash-attention@" + "f" * 40 + "+"
    spelled = "\0".join([FACTS.id, COMMIT, fa2, "rules", PLAN.arch_list, "templates",
                         ",".join(PLAN.extensions), "1.0"])
    assert content_key(FACTS, (COMMIT, fa2), PLAN, "rules", "templates") == \
        hashlib.sha256(spelled.encode()).hexdigest()[:24]
