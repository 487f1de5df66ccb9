"""vLLM's Marlin GEMM kernels (`_C`), read from their names, and the `marlin_gemm` inputs
that launch each one (`sm121-build prove`: the GEMM cases of harness_marlin.py come from the
kernels a file added).

Standard library only; harness_marlin.py, run as a script, imports it as its sibling.

1. `parse(name)`: a mangled `marlin::Marlin<...>` name read into a `Kernel`: its four
   `vllm::ScalarType` ids (activation, weight, output, scales), threads, thread_m_blocks,
   thread_n_blocks, thread_k_blocks, m_block_size_8, stages, group_blocks and is_zp_float,
   as csrc/quantization/marlin/generate_kernels.py instantiates them (vLLM 0.20 to 0.22: the
   twelve-argument template).  A name of another shape is not one of these (None).
2. `launched(case, sizes)`: the kernels one `marlin_gemm` call launches, the dispatch of
   vLLM 0.22.0's marlin.cu (`marlin_gemm`, `marlin_mm`, `determine_exec_config`,
   `is_valid_config`, `get_kernel_cache_size`): the split of M, the thread config, the
   shared memory each needs against the GPU's opt-in limit, the override to (128, 64, 128)
   when few blocks would run, and the kernels generate_kernels.py instantiates.  A call
   those functions refuse (a TORCH_CHECK) launches nothing.
3. `derive(names, sizes)`: one case per kernel, its template arguments turned back into
   inputs (M from thread_m_blocks and m_block_size_8; the group size from group_blocks; a
   zero point for a weight type without a bias; the smallest N and K, of a list made from
   the GPU's SM count, for which the dispatch picks that thread config), each checked with
   `launched`; the kernels no case launches returned with why.

`python3 marlin_kernels.py NAMES.txt [CC SMEM_BLOCK SMS]`: the derivation as JSON.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

try:  # a module of the package, or a harness's sibling where it runs as a script
    from . import case_files
except ImportError:
    import case_files  # type: ignore[no-redef, import-not-found]


@dataclass(frozen=True)
class ScalarType:
    """A `vllm::ScalarType`'s fields, as csrc/core/scalar_type.hpp orders them."""

    exponent: int
    mantissa: int
    signed: bool
    bias: int = 0
    finite: bool = False
    nan: int = 1  # NAN_IEEE_754; 0 NAN_NONE, 2 NAN_EXTD_RANGE_MAX_MIN

    @property
    def id(self) -> int:
        """`ScalarType::id()`: exponent (8 bits), mantissa (8), signed (1), bias (32),
        finite_values_only (1), nan_repr (8), packed from the low bit up."""
        return (self.exponent | self.mantissa << 8 | int(self.signed) << 16
                | (self.bias & 0xFFFFFFFF) << 17 | int(self.finite) << 49 | self.nan << 50)


# scalar_type.hpp's types, by id: (name, size in bits, torch dtype of a tensor holding it)
TYPES: dict[int, tuple[str, int, str]] = {
    ScalarType(5, 10, True).id: ("kFloat16", 16, "float16"),
    ScalarType(8, 7, True).id: ("kBFloat16", 16, "bfloat16"),
    ScalarType(0, 7, True).id: ("kS8", 8, "int8"),
    ScalarType(0, 4, False).id: ("kU4", 4, "int32"),
    ScalarType(0, 4, False, 8).id: ("kU4B8", 4, "int32"),
    ScalarType(0, 8, False).id: ("kU8", 8, "int32"),
    ScalarType(0, 8, False, 128).id: ("kU8B128", 8, "int32"),
    ScalarType(4, 3, True, 0, True, 2).id: ("kFE4M3fn", 8, "float8_e4m3fn"),
    ScalarType(2, 1, True, 0, True, 0).id: ("kFE2M1f", 4, "int32"),
    ScalarType(8, 0, False, 0, True, 2).id: ("kFE8M0fnu", 8, "float8_e8m0fnu"),
}
ID = {name: number for number, (name, _, _) in TYPES.items()}
ZERO_POINT = ("kU4", "kU8")  # weight types that take b_zeros (AWQ)
STAGES = 4  # marlin_mm's pipeline depth on every GPU but Turing (7.5: 2)
MIN_THREAD_N = MIN_THREAD_K = 64  # marlin.cuh
TILE = 16
# the thread configs (thread_k, thread_n, threads) determine_exec_config tries, in order
SMALL = ((128, 128, 256), (64, 128, 128), (128, 64, 128))
LARGE = ((64, 256, 256), (64, 128, 128), (128, 64, 128))
MAX_N = 1 << 16  # the widest N a case has
MOE_BLOCKS = (8, 16, 32, 48, 64)  # moe_wna16_marlin_gemm's moe_block_size
MOE_TILES = ((128, 128), (64, 256), (64, 128), (128, 64))  # (thread_k, thread_n), its threads
MOE_EXPERTS, MOE_TOP_K = 4, 2  # a MoE case's experts, and how many each token is routed to

_NAME = re.compile(
    r"_ZN(6marlin|16marlin_moe_wna16)6MarlinILl(\d{1,20})ELl(\d{1,20})ELl(\d{1,20})ELl(\d{1,20})ELi(\d{1,5})E"
    r"Li(\d{1,2})ELi(\d{1,3})ELi(\d{1,3})ELb([01])ELi(\d{1,2})ELi(n?\d{1,4})ELb([01])EEEv")


@dataclass(frozen=True, order=True)
class Kernel:
    """One `marlin::Marlin<...>` instantiation, its template arguments by their names."""

    a: int
    b: int
    c: int
    s: int
    threads: int
    m_blocks: int
    n_blocks: int
    k_blocks: int
    m8: bool
    stages: int
    group_blocks: int
    zp_float: bool
    moe: bool = False  # marlin_moe_wna16's (`_moe_C`), not marlin's (`_C`)

    def describe(self) -> str:
        names = [TYPES.get(t, (str(t),))[0] for t in (self.a, self.b, self.c, self.s)]
        return (f"{'MoE ' if self.moe else ''}Marlin<{', '.join(names)}, {self.threads} "
                f"threads, m{self.m_blocks}"
                f"{' (8)' if self.m8 else ''} n{self.n_blocks} k{self.k_blocks}, group "
                f"{self.group_blocks}{', float zero point' if self.zp_float else ''}>")


def parse(name: str) -> Kernel | None:
    """The Marlin GEMM kernel `name` is, or None for a name of another shape."""
    found = _NAME.match(name) if len(name) < 512 else None
    if found is None:
        return None
    moe, *g = found.groups()
    a, b, c, s, threads, m_blocks, n_blocks, k_blocks = (int(x) for x in g[:8])
    group = -int(g[10][1:]) if g[10].startswith("n") else int(g[10])
    return Kernel(a, b, c, s, threads, m_blocks, n_blocks, k_blocks, g[8] == "1", int(g[9]),
                  group, g[11] == "1", moe != "6marlin")


@dataclass(frozen=True)
class Sizes:
    """What marlin_mm reads of the GPU: its compute capability, the opt-in shared memory
    per block, the SM count."""

    major: int
    minor: int
    smem_per_block: int
    sms: int


H100_SIZES = Sizes(9, 0, 232448, 132)


@dataclass(frozen=True)
class Case:
    """One `marlin_gemm` call: the activation's type, the output's (the scales' for an
    8-bit activation), the weight's and the scales', M x N x K, the group size (-1: one
    group, the channel; with `act_order`, the groups of g_idx), `act_order` (g_idx and a
    permutation given) with `k_full`, and a zero point (`zero`)."""

    a: str = "kFloat16"
    c: str = "kFloat16"
    b: str = "kU4B8"
    s: str = "kFloat16"
    m: int = 16
    n: int = 256
    k: int = 256
    group: int = -1
    act_order: bool = False
    k_full: bool = True
    zero: bool = False
    moe_block: int = 0  # moe_wna16_marlin_gemm's moe_block_size (0: marlin_gemm's case)
    tile: tuple[int, int] = (0, 0)  # MoE: the (thread_k, thread_n) it is given

    @property
    def key(self) -> str:
        """The case's name in the harness's outputs (types, shape, grouping; MoE: the block
        size and the tile)."""
        types = "-".join(t[1:] for t in (self.a, self.b, self.c, self.s))
        order = ("-act" + ("" if self.k_full else "-kpart")) if self.act_order else ""
        moe = f"-moe{self.moe_block}-t{self.tile[0]}x{self.tile[1]}" if self.moe_block else ""
        return (f"{types}-m{self.m}n{self.n}k{self.k}-g{self.group}{order}"
                f"{'-zp' if self.zero else ''}{moe}").lower()

    @property
    def name(self) -> str:
        """The case's name among all cases (`Derived.expects`' key): its key, which names
        the op already (a MoE case's carries `-moe`)."""
        return self.key


def _bits(name: str) -> int:
    return TYPES[ID[name]][1]


def invalid(case: Case) -> str | None:
    """Why `marlin_gemm` refuses the case before any launch (None: it does not)."""
    for name in (case.a, case.b, case.c, case.s):
        if name not in ID:
            return f"unknown type {name}"
    if not (0 < case.m <= 1 << 16 and 0 < case.n <= MAX_N and 0 < case.k <= 1 << 16):
        return "M, N, K out of range"
    if case.k % TILE or case.n % MIN_THREAD_N:
        return "K is not a multiple of 16 or N of 64"
    if _bits(case.a) == 16 and case.c != case.a:
        return "a 16-bit activation's output is its own type"
    if case.zero != (case.b in ZERO_POINT):
        return "a zero point goes with kU4 and kU8 alone"
    groups = _groups(case)
    if groups < 1 or case.k % groups:
        return "K is not a whole number of groups"
    if case.act_order and case.k_full and groups <= 1:
        return "act_order with a full K needs more than one group"
    if case.group not in (-1,) and case.group % TILE:
        return "a group size is a multiple of 16"
    if case.moe_block and (case.moe_block not in MOE_BLOCKS or case.tile not in MOE_TILES):
        return "a MoE block size of 8, 16, 32, 48 or 64 and a tile of the four"
    if not case.moe_block and case.tile != (0, 0):
        return "a tile is given to the MoE op alone"
    return None


def _groups(case: Case) -> int:
    return 1 if case.group == -1 else max(case.k // case.group, 0) if case.group else 0


@dataclass(frozen=True)
class Grouping:
    """A call as marlin_mm sees it after its checks: the case, its group size (-1: one
    group; 0: act_order's groups, K not full) and whether act_order is still on (a full K
    turns it off)."""

    case: Case
    group_size: int
    act_order: bool


def _cache_size(cfg: tuple[int, int, int], m_blocks: int, call: Grouping) -> int:
    """get_kernel_cache_size (with get_scales_cache_size; MoE's adds the block's sorted
    ids and weights)."""
    tb_k, tb_n, _ = cfg
    case, group_size = call.case, call.group_size
    bits, a8 = _bits(case.b), _bits(case.a) == 8
    chunk = call.act_order and not case.k_full
    groups = 1 if group_size == -1 else -(-tb_k // 32) if group_size == 0 else \
        -(-tb_k // group_size)
    scales = max(groups * STAGES * 2, 32) * tb_n * 2 if chunk else groups * tb_n * 2 * STAGES
    sh_a = STAGES * (m_blocks * 16 * tb_k) * (1 if a8 else 2)
    sh_b = STAGES * (tb_k * tb_n // (32 // bits)) * 4
    sh_red = m_blocks * 16 * (tb_n + 8) * 2
    tmp = max(max(sh_b, sh_red), min(sh_b, sh_red) + tb_n * 2)
    g_idx = STAGES * tb_k // 4 if chunk else 0
    zp = (scales // 4 if bits == 4 else scales // 2) if case.zero else 0  # not is_zp_float
    meta = m_blocks * 16 * 16 if case.moe_block else 0
    return tmp + sh_a + scales + zp + g_idx + meta


def _valid(cfg: tuple[int, int, int], m_blocks: int, call: Grouping, smem: int) -> bool:
    """is_valid_config: the tile divides N and K, and its pipeline fits `smem`."""
    tb_k, tb_n, threads = cfg
    if call.case.k % tb_k or call.case.n % tb_n or tb_n < MIN_THREAD_N \
            or tb_k < MIN_THREAD_K or threads < 128:
        return False
    return _cache_size(cfg, m_blocks, call) <= smem


def built(a: str, m_blocks: int, m8: bool, cfg: tuple[int, int, int]) -> bool:
    """Whether generate_kernels.py instantiates this shape (for any types it builds): the
    256-thread configs only (128, 128) for one M block and (64, 256) for more; 8-bit
    activations without the 8-row block."""
    tb_k, tb_n, threads = cfg
    if m8 and (m_blocks != 1 or _bits(a) != 16):
        return False
    if threads == 256:
        return (tb_k, tb_n) == ((128, 128) if m_blocks <= 1 else (64, 256))
    return (tb_k, tb_n) in ((64, 128), (128, 64))


def _kernel(case: Case, m_blocks: int, m8: bool, cfg: tuple[int, int, int], group_blocks: int
            ) -> Kernel:
    tb_k, tb_n, threads = cfg
    return Kernel(ID[case.a], ID[case.b], ID[case.c], ID[case.s], threads, m_blocks,
                  tb_n // 16, tb_k // 16, m8, STAGES, group_blocks, False)


def launched(case: Case, sizes: Sizes, exists: frozenset[Kernel] | None = None
             ) -> tuple[Kernel, ...]:
    """The Marlin GEMM kernels one call launches, in order (see the module's docstring);
    `exists`: the kernels the file has, when known (a shape generate_kernels.py builds
    otherwise)."""
    if invalid(case) is not None:
        return ()
    cc = sizes.major * 10 + sizes.minor
    if cc < 75 or cc == 75 or (case.a == "kFE4M3fn" and cc not in (89, 120)):
        return ()  # Turing's 2 stages are not modeled; FP8 activations: SM89/SM120 only
    groups = _groups(case)
    act_order = case.act_order
    group_size = (case.k // groups if case.k_full else 0) if act_order else \
        (-1 if groups <= 1 else case.k // groups)
    group_blocks = (group_size // 16 if case.k_full else 0) if act_order else \
        (-1 if group_size == -1 else group_size // 16)
    call = Grouping(case, group_size, act_order and not case.k_full)
    act_order = call.act_order
    smem = sizes.smem_per_block
    a16 = _bits(case.a) == 16
    if case.moe_block:
        return _launched_moe(case, call, (group_blocks, smem), exists)

    def has(kernel: Kernel, m_blocks: int, m8: bool, cfg: tuple[int, int, int]) -> bool:
        return kernel in exists if exists is not None else built(case.a, m_blocks, m8, cfg)

    out: list[Kernel] = []
    rest, max_m_blocks = case.m, 4
    max_par = 16 * 8 if case.n <= 4096 else 16
    while rest:
        par = min(rest // (max_m_blocks * 16), max_par)
        split = par * max_m_blocks * 16 if par > 0 else rest
        m_blocks = min(-(-split // 16), max_m_blocks)
        m8 = split <= 8 and a16
        chosen: tuple[int, int, int] | None = None
        for cfg in LARGE if m_blocks > 1 else SMALL:
            if not _valid(cfg, m_blocks, call, smem - 512):
                continue
            gb = 0 if act_order else group_blocks
            if has(_kernel(case, m_blocks, m8, cfg, gb), m_blocks, m8, cfg):
                chosen = cfg
                break
        if chosen is not None and case.n // chosen[1] * -(-split // (m_blocks * 16)) * 4 \
                <= sizes.sms and _valid((128, 64, 128), m_blocks, call, smem):
            chosen = (128, 64, 128)
        if chosen is None:
            if max_m_blocks > 1:
                max_m_blocks -= 1
                continue
            return ()
        if not _valid(chosen, m_blocks, call, smem):
            return ()
        kernel = _kernel(case, m_blocks, m8, chosen, group_blocks)
        if not has(kernel, m_blocks, m8, chosen):
            return ()
        out.append(kernel)
        rest -= split
    return tuple(out)


def _launched_moe(case: Case, call: Grouping, at: tuple[int, int],
                  exists: frozenset[Kernel] | None) -> tuple[Kernel, ...]:
    """The kernel one moe_wna16_marlin_gemm call launches: its tile given (thread_k,
    thread_n; threads their product / 64), its M blocks from moe_block_size (8: one block of
    8 rows), if the pipeline fits the shared memory (`at`: group_blocks, the opt-in bytes)
    and the kernel is built."""
    group_blocks, smem = at
    m_blocks, m8 = -(-case.moe_block // 16), case.moe_block == 8
    if m8 and _bits(case.a) != 16:
        return ()
    tb_k, tb_n = case.tile
    cfg = (tb_k, tb_n, tb_k * tb_n // 64)
    if not _valid(cfg, m_blocks, call, smem):
        return ()
    kernel = replace(_kernel(case, m_blocks, m8, cfg, group_blocks), moe=True)
    built_here = kernel in exists if exists is not None else built(case.a, m_blocks, m8, cfg)
    return (kernel,) if built_here else ()


def _n_tried(sizes: Sizes) -> set[int]:
    """N of one to eight tiles of 64, and just past the override's threshold (N / thread_n
    * 4 > the SM count) for each width, an odd and an even count of tiles."""
    past = sizes.sms // 4 + 1
    ns = {64 * j for j in (1, 2, 3, 4, 5, 6, 8)}
    for width in (64, 128, 256):
        ns.update(width * j for j in (past, past + 1, 2 * past, 2 * past + 1))
    return ns


def every_class_tried(sizes: Sizes) -> bool:
    """Whether the N tried reach past the threshold of this SM count within the N a case may
    have: only then does finding no case show a kernel unreachable (an SM count a lying
    loader says can put the threshold past any N)."""
    return sizes.sms > 0 and max(_n_tried(sizes)) <= MAX_N


def _sizes_tried(sizes: Sizes) -> list[tuple[int, int]]:
    """(N, K) pairs, the cheapest first: `_n_tried`'s N; K of one or more 64- and 128-row
    tiles, odd counts of 64 among them."""
    ks = [64, 128, 192, 256, 384, 512, 640, 768, 1024, 2048]
    return sorted(((n, k) for n in _n_tried(sizes) if n <= MAX_N for k in ks),
                  key=lambda p: p[0] * p[1])


def _proposals(k: Kernel, sizes: Sizes) -> list[Case]:
    """The cases that may launch `k`: its types, an M its blocks select, its grouping; each
    N x K of `_sizes_tried`."""
    names = [TYPES[t][0] if t in TYPES else "" for t in (k.a, k.b, k.c, k.s)]
    if "" in names or k.zp_float or k.stages != STAGES:
        return []
    a, b, c, s = names
    m = 8 if k.m8 else 16 * k.m_blocks
    zero = b in ZERO_POINT
    out = []
    if k.moe:
        tile = (16 * k.k_blocks, 16 * k.n_blocks)
        for n, kk in ((256, 256), (512, 512), (256, 1024), (1024, 256)):
            group = 64 if k.group_blocks == 0 else -1 if k.group_blocks == -1 else \
                16 * k.group_blocks
            act = k.group_blocks == 0
            out.append(Case(a, c, b, s, 3 * m, n, kk, group, act, not act, zero, m, tile))
        return out
    for n, kk in _sizes_tried(sizes):
        if k.group_blocks == 0:  # act_order, K not full: g_idx's groups of 64 or 128 rows
            out.append(Case(a, c, b, s, m, n, kk, 128 if kk % 256 == 0 else 64, True, False,
                            zero))
        elif k.group_blocks == -1:
            out.append(Case(a, c, b, s, m, n, kk, -1, False, True, zero))
        else:
            size = 16 * k.group_blocks
            if kk % size == 0:
                out.append(Case(a, c, b, s, m, n, kk, size, False, True, zero))
    return out


@dataclass
class Derived:
    """`derive`'s answer: the cases in order, each with the kernels it is expected to
    launch; the Marlin kernels no case launches, each with why; the names that are not
    Marlin GEMM kernels (`foreign`: another op's, not modeled here)."""

    cases: list[Case] = field(default_factory=list)
    expects: dict[str, list[str]] = field(default_factory=dict)  # case key -> kernel names
    unreachable: dict[str, str] = field(default_factory=dict)  # kernel name -> why
    foreign: list[str] = field(default_factory=list)
    dead_rules: dict[str, str] = field(default_factory=dict)

    def dead(self) -> dict[str, str]:
        """The kernels no call can launch on this GPU, each with the rule that says so."""
        return dict(self.dead_rules)

    def to_json(self) -> dict[str, Any]:
        return {"cases": [{**asdict(c), "key": c.key, "expects": self.expects[c.key]}
                          for c in self.cases],
                "unreachable": self.unreachable, "foreign": self.foreign}


NOT_FOUND = "no case of the model (M, N, K of its list) launched it"
NOT_TRIED = "the derivation's budget of dispatch evaluations ran out before it"
BUDGET = 50_000  # dispatch evaluations: vLLM 0.22.0's _C takes 8,643, its _moe_C 732
DEFAULTS = ("_ZN6marlin13MarlinDefault", "_ZN16marlin_moe_wna1613MarlinDefault")  # the
# placeholder marlin_mm refuses (a TORCH_CHECK) before launching


def _rule(k: Kernel, sizes: Sizes) -> str | None:
    """A rule of the dispatch that never selects `k` on this GPU (None: none known)."""
    cc = sizes.major * 10 + sizes.minor
    if k.a == ID["kFE4M3fn"] and cc not in (89, 120):
        return "marlin_mm refuses an FP8 activation but on SM89 and SM120"
    if k.stages != (2 if cc == 75 else STAGES):
        return f"marlin_mm runs {STAGES} stages here, the kernel has {k.stages}"
    if k.zp_float:
        return "no op of this library passes is_zp_float with these types (not modeled)"
    return None


def derive(names: list[str], sizes: Sizes, budget: int = BUDGET) -> Derived:
    """One case per Marlin GEMM kernel of `names` that some case of the list launches, the
    cases deduplicated; the rest said (see the module's docstring).  `budget`: the dispatch
    evaluations it may spend (a file of many made-up names costs no more); the kernels it
    did not get to are said so, not called unreachable."""
    out = Derived()
    kernels: dict[Kernel, str] = {}
    for name in names:
        k = parse(name)
        if k is None:
            if name.startswith(DEFAULTS):
                out.dead_rules[name] = ("the placeholder marlin_mm refuses (TORCH_CHECK) "
                                        "instead of launching: no call launches it")
            else:
                out.foreign.append(name)
        else:
            kernels.setdefault(k, name)
    covered: set[Kernel] = set()
    for k in sorted(kernels):
        if k in covered:
            continue
        rule = _rule(k, sizes)
        if rule is not None:
            out.dead_rules[kernels[k]] = rule
            continue
        proposals = _proposals(k, sizes) if budget > 0 else []
        if budget <= 0:
            out.unreachable[kernels[k]] = NOT_TRIED
        for case in proposals:
            budget -= 1
            if budget < 0:
                out.unreachable[kernels[k]] = NOT_TRIED
                break
            hits = launched(case, sizes)
            if k in hits:
                if case.key not in out.expects:
                    out.cases.append(case)
                    out.expects[case.key] = [kernels[h] for h in hits if h in kernels]
                covered.update(hits)
                break
        else:
            if proposals and k.moe:  # the tile is given: only the shared memory refuses
                out.dead_rules[kernels[k]] = (
                    f"the tile it is given does not fit {sizes.smem_per_block} bytes of "
                    "shared memory a block with its M blocks and grouping")
            elif proposals and every_class_tried(sizes):  # every class of N and K was tried
                out.dead_rules[kernels[k]] = (
                    f"with {sizes.smem_per_block} bytes of shared memory a block and "
                    f"{sizes.sms} SMs, its M with every N (mod 256, each side of the "
                    "SM-count threshold) and K (mod 128) picks another thread config")
    out.unreachable = {kernels[k]: out.unreachable.get(kernels[k], NOT_FOUND)
                       for k in sorted(kernels)
                       if k not in covered and kernels[k] not in out.dead_rules}
    out.unreachable.update(out.dead_rules)
    return out


def cases_from_json(data: Any) -> list[Case]:
    """Cases as `Derived.to_json` writes them (outside input: each field checked)."""
    return case_files.checked_cases(data, lambda _item: Case(), ("tile",), invalid)


USAGE = "usage: marlin_kernels.py NAMES.txt [CC SMEM_BLOCK SMS]"


def main(argv: list[str]) -> int:
    """The derivation as JSON; a bad argument or file in one `usage:` line, exit 2."""
    return case_files.derivation_main(argv, USAGE, (H100_SIZES, "a byte count and an SM count"),
                                      derive)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
