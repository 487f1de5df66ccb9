"""Every route that places files (or writes results) against every policy: one table.

A route is a way files the user did not build in this run, or built in it, end up in an
image, a registry or a folder; a policy is a rule each such route must apply.  Each cell
says where the route applies the policy (a function it reaches) or why the policy does not
apply to it.  `tests/unit/test_routes.py` is generated from this table: every route has a
cell for every policy, every named function is reached from the route's own entry points
in the code (a static call graph of the package), and ARCHITECTURE.md shows this table as
`table()` renders it.  A new route or policy is a new row or column here, and a test fails
until each of its cells is filled.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Safeguard(Enum):
    PLACEMENT = "placement allow-list"
    HOST_CODE = "host-code check"
    TRUST_KEY = "trust key"
    TAG_RULE = "tag rule"
    TIME_LIMITS = "time limits"


@dataclass(frozen=True)
class Reached:
    """The policy is applied by this function (`module:Qualified.name` under sm121_build),
    which the route's code reaches; `shown` is what the table says when the function is not
    the whole story (the engine's calls are limited inside the engine)."""

    function: str
    shown: str = ""


@dataclass(frozen=True)
class NotApplicable:
    """The policy has nothing to act on in this route, and why."""

    why: str


Cell = Reached | NotApplicable


@dataclass(frozen=True)
class Route:
    name: str
    entries: tuple[str, ...]  # where the route starts in the code (`module:function`)
    cells: dict[Safeguard, Cell]


# every call on the engine is limited inside it (image.engine.Engine: the client's timeout,
# SM121_ENGINE_TIMEOUT; tests/unit/test_time_limits.py): a route that builds reaches it
ENGINE_LIMIT = Reached("image.api:ImageEngine.build", "the engine's calls")
REGISTRY_LIMIT = Reached("image.registry_http:HttpDoor.call")
TAGS = Reached("jobs.framework.pipeline:require_tags_free")
HOST = Reached("verify.checks:check_host_code")
PLACED = Reached("jobs.kernel_images.injection:require_known_paths")
COMPILED = NotApplicable("compiled in this run from the base's own files: nothing to trust")

ROUTES: tuple[Route, ...] = (
    Route("build (main job)", ("jobs.main_run.main_job:run_build",), {
        Safeguard.PLACEMENT: NotApplicable("places only the base's own extension files, chosen "
                                        "from the base (main_plan.choose_to_build)"),
        Safeguard.HOST_CODE: HOST,
        Safeguard.TRUST_KEY: COMPILED,
        Safeguard.TAG_RULE: TAGS,
        Safeguard.TIME_LIMITS: ENGINE_LIMIT,
    }),
    Route("aot FILE", ("jobs.aot_work.aot_files:run_aot",), {
        Safeguard.PLACEMENT: NotApplicable("places nothing in an image: each result at its own "
                                        "claimed path under --out (core.outputs.Results)"),
        Safeguard.HOST_CODE: Reached("verify.aot_check:check_aot"),
        Safeguard.TRUST_KEY: Reached("jobs.aot_work.aot_files:_cached_entry"),
        Safeguard.TAG_RULE: NotApplicable("tags nothing"),
        Safeguard.TIME_LIMITS: Reached("cuda.ptxas:compile_ptx"),
    }),
    Route("aot IMAGE", ("cli.aot:_aot_image",), {
        Safeguard.PLACEMENT: NotApplicable("places only the base's own extension files, aot'd"),
        Safeguard.HOST_CODE: HOST,
        Safeguard.TRUST_KEY: COMPILED,
        Safeguard.TAG_RULE: TAGS,
        Safeguard.TIME_LIMITS: ENGINE_LIMIT,
    }),
    Route("inject --artifacts", ("cli.inject:inject",), {
        Safeguard.PLACEMENT: PLACED,
        Safeguard.HOST_CODE: HOST,
        Safeguard.TRUST_KEY: Reached("jobs.formats.artifacts:_require_signed"),
        Safeguard.TAG_RULE: TAGS,
        Safeguard.TIME_LIMITS: ENGINE_LIMIT,
    }),
    Route("inject --from", ("jobs.kernel_images.kernels_image:fetch_step",
                            "jobs.kernel_images.injection:run_inject"), {
        Safeguard.PLACEMENT: PLACED,
        Safeguard.HOST_CODE: HOST,
        Safeguard.TRUST_KEY: Reached("image.cosign:require_signed"),
        Safeguard.TAG_RULE: TAGS,
        Safeguard.TIME_LIMITS: REGISTRY_LIMIT,
    }),
    Route("--kernels-from (a hit, and with --no-build)",
          ("jobs.main_run.run:LookUp.__call__", "jobs.main_run.run:InjectHit.__call__"), {
              Safeguard.PLACEMENT: PLACED,
              Safeguard.HOST_CODE: HOST,
              Safeguard.TRUST_KEY: Reached("image.cosign:require_signed"),
              Safeguard.TAG_RULE: TAGS,
              Safeguard.TIME_LIMITS: REGISTRY_LIMIT,
          }),
    Route("kernels publish", ("cli.kernels:publish_command",), {
        Safeguard.PLACEMENT: Reached("jobs.formats.artifacts:load"),
        Safeguard.HOST_CODE: NotApplicable("no base to compare with here: every consumer's "
                                        "inject checks the files against its own base"),
        Safeguard.TRUST_KEY: Reached("jobs.formats.artifacts:_require_signed"),
        Safeguard.TAG_RULE: TAGS,
        Safeguard.TIME_LIMITS: ENGINE_LIMIT,
    }),
    Route("--kernels-to", ("jobs.main_run.run:Publish.__call__",), {
        Safeguard.PLACEMENT: Reached("jobs.formats.artifacts:load"),
        Safeguard.HOST_CODE: NotApplicable("the files were verified in this run, before it "
                                        "publishes (Publish runs after Build)"),
        Safeguard.TRUST_KEY: COMPILED,
        Safeguard.TAG_RULE: TAGS,
        Safeguard.TIME_LIMITS: ENGINE_LIMIT,
    }),
)


def table() -> str:
    """The table as ARCHITECTURE.md shows it (Markdown)."""
    policies = list(Safeguard)
    lines = ["| route | " + " | ".join(p.value for p in policies) + " |",
             "|---" * (len(policies) + 1) + "|"]
    for route in ROUTES:
        cells = [(c.shown or f"`{c.function.split(':')[-1]}`") if isinstance(c, Reached)
                 else "n/a" for c in (route.cells[p] for p in policies)]
        lines.append(f"| {route.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
