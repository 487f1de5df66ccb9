"""vLLM FA2's kernels, read from their names, and the op inputs that launch each one
(`sm121-build prove`: the cases of harness_fa2.py come from the kernels a file added).

Standard library only; harness_fa2.py, run as a script, imports it as its sibling.

1. `parse(name)`: a mangled kernel name (`_ZN5flash16flash_fwd_kernelI23Flash_fwd_kernel_
   traitsILi128E...`) read into a `Kernel`: its kind, its `Flash_fwd_kernel_traits` (head
   dim, kBlockM, kBlockN, warps, Is_Q_in_regs, Share_Q_K_smem, element type) and its own
   template arguments, named as flash_fwd_launch_template.h names them.  The Itanium
   mangling is read directly (`_template_args`), for the shapes FA2's names have.
2. `launched(case, gpu)`: the kernels one call of `varlen_fwd`, `fwd_kvcache`,
   `fwd_sparse` or `varlen_fwd_sparse` launches, the dispatch of
   vllm-project/flash-attention at 7d346be6 (flash_api.cpp's mha_varlen_fwd and
   mha_fwd_kvcache, flash_fwd_launch_template.h's run_flash_fwd, run_flash_splitkv_fwd and
   run_mha_fwd_hdim*; flash_api_sparse.cpp's mha_fwd_sparse, mha_varlen_fwd_sparse and
   run_mha_fwd_sparse, flash_fwd_sparse_launch_template.h's run_flash_sparse_fwd): the
   library vLLM 0.22.0 ships (no split-align kernels).  A case those functions refuse (a
   TORCH_CHECK) launches nothing.
3. `derive(names, gpu)`: cases that together launch every kernel some case can launch:
   one per kernel first (its template arguments turned back into inputs, `_proposals`,
   each checked with `launched`), deduplicated, then a seeded random search over the
   inputs for what is left; the rest returned unreachable, each with the reason (so are
   the names of FA2's that `parse` refuses).

`python3 fa2_kernels.py NAMES.txt [CC SMEM_BLOCK SMEM_SM]`: the derivation as JSON.
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

try:  # a module of the package, or a harness's sibling where it runs as a script
    from . import case_files
except ImportError:
    import case_files  # type: ignore[no-redef, import-not-found]

# each kind's own template arguments after Kernel_traits, in the order of their template
FLAGS = {
    "flash_fwd_kernel": ("Is_dropout", "Is_causal", "Is_local", "Has_alibi", "Is_even_MN",
                         "Is_even_K", "Is_softcap", "Return_softmax"),
    "flash_fwd_splitkv_kernel": ("Is_causal", "Is_local", "Has_alibi", "Is_even_MN",
                                 "Is_even_K", "Is_softcap", "Split", "Append_KV"),
    "flash_fwd_splitkv_combine_kernel": ("kBlockM", "Log_max_splits", "Is_even_K"),
    "flash_fwd_sparse_kernel": ("Is_dropout", "Is_causal", "Is_local", "Has_alibi",
                                "Is_even_MN", "Is_even_K", "Is_softcap", "Return_softmax"),
}
DTYPES = {"cutlass::bfloat16_t": "bfloat16", "cutlass::half_t": "float16"}
HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # HEADDIM_SWITCH's buckets
OPS = ("varlen_fwd", "fwd_kvcache")
SPARSE_OPS = ("fwd_sparse", "varlen_fwd_sparse")  # vertical-slash sparse attention
SPARSE_TRAITS = (128, 64, 64, 4)  # the only head dim run_mha_fwd_sparse takes, its block
# the bounds of what `parse` reads: FA2's names nest template arguments 3 deep, their
# numbers have a few digits; a name beyond them is not one of FA2's
MAX_DEPTH = 8
MAX_DIGITS = 12
# the largest case the harness runs (a case file is outside input: its sizes are bounded
# before any tensor is made; the derived cases stay far below)
MAX_BATCH, MAX_HEADS, MAX_SEQLEN = 64, 256, 1 << 16
# and the elements of its largest input (batch x heads x sequence x head size: 512 MiB of
# bfloat16), each size within its bound but their product never hundreds of gigabytes
MAX_ELEMENTS = 1 << 28
MAX_SOFTCAP = 1e4  # a softcap is a few tens (Gemma 2's 50); never inf or NaN
# each kind's int template arguments (the others are bools), with their (low, high) bounds
INT_FLAGS = {"kBlockM": (1, 1024), "Log_max_splits": (0, 16)}


class NameError_(ValueError):
    """A kernel name this module cannot read."""


# --- 1. names ---------------------------------------------------------------------------

def _source_name(text: str, at: int) -> tuple[str, int]:
    """`<length><identifier>` at `at`."""
    end = at
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == at or end - at > MAX_DIGITS:
        raise NameError_(f"no source name at {at}")
    size = int(text[at:end])
    return text[end:end + size], end + size


def _nested(text: str, at: int) -> tuple[str, int]:
    """`N<name>...E` (no template arguments inside) at `at`: `a::b`."""
    parts, at = [], at + 1
    while text[at] != "E":
        part, at = _source_name(text, at)
        parts.append(part)
    return "::".join(parts), at + 1


def _template_args(text: str, at: int, subs: list[Any], depth: int = 1
                   ) -> tuple[list[Any], int]:
    """`I<arg>...E` at `at`: each argument an int or bool literal (`Li4E`, `Lb1E`, `Ll…E`),
    a nested name (`N7cutlass6half_tE`), a substitution (`S3_`: read from `subs`, the names
    seen so far in mangling order), or a name with its own arguments (`19Flash_kernel_
    traitsI…E`: a tuple of the name and its arguments), `depth` deep (at most `MAX_DEPTH`;
    each number at most `MAX_DIGITS` long)."""
    if depth > MAX_DEPTH:
        raise NameError_(f"template arguments nested over {MAX_DEPTH} deep at {at}")
    if text[at] != "I":
        raise NameError_(f"no template arguments at {at}")
    args: list[Any] = []
    at += 1
    while text[at] != "E":
        c = text[at]
        if c == "L":
            kind, end = text[at + 1], text.index("E", at)
            literal = text[at + 2:end]
            if len(literal) > MAX_DIGITS:
                raise NameError_(f"a literal of over {MAX_DIGITS} characters at {at}")
            literal = "-" + literal[1:] if literal.startswith("n") else literal
            args.append(bool(int(literal)) if kind == "b" else int(literal))
            at = end + 1
        elif c == "N":
            name, at = _nested(text, at)
            subs.append(name)
            args.append(name)
        elif c == "S":
            end = text.index("_", at)
            if end - at > MAX_DIGITS:
                raise NameError_(f"a substitution of over {MAX_DIGITS} characters at {at}")
            index = 0 if end == at + 1 else int(text[at + 1:end], 36) + 1
            args.append(subs[index] if index < len(subs) else f"S{index}")
            at = end + 1
        elif c.isdigit():
            name, at = _source_name(text, at)
            subs.append(name)
            if at < len(text) and text[at] == "I":
                inner, at = _template_args(text, at, subs, depth + 1)
                args.append((name, tuple(inner)))
                subs.append((name, tuple(inner)))
            else:
                args.append(name)
        else:
            raise NameError_(f"template argument {c!r} at {at} is not one FA2's names have")
    return args, at + 1


@dataclass(frozen=True, order=True)
class Traits:
    """`Flash_fwd_kernel_traits<kHeadDim, kBlockM, kBlockN, kNWarps, Is_Q_in_regs,
    Share_Q_K_smem, elem_type>`."""

    head_dim: int
    block_m: int
    block_n: int
    warps: int
    q_in_regs: bool
    share_qk: bool
    dtype: str  # "bfloat16" | "float16"


@dataclass(frozen=True, order=True)
class Kernel:
    """A kernel as its template arguments select it: `args`, its kind's `FLAGS` in order."""

    kind: str
    traits: Traits
    args: tuple[int | bool, ...]

    def flag(self, name: str) -> Any:
        return self.args[FLAGS[self.kind].index(name)]

    def describe(self) -> str:
        t = self.traits
        named = ", ".join(f"{n}={int(v) if isinstance(v, bool) else v}"
                          for n, v in zip(FLAGS[self.kind], self.args, strict=True))
        return (f"{self.kind}<{t.dtype} d{t.head_dim} {t.block_m}x{t.block_n} "
                f"w{t.warps}{' qreg' if t.q_in_regs else ''}{' shareqk' if t.share_qk else ''}"
                f", {named}>")


def _shown(value: Any) -> str:
    """A template argument as a message names it, in at most 48 characters: a template by
    its name alone (a substitution, `S3_`, stands for a template read before, so a name of
    a few hundred bytes can hold templates whose arguments, written out, are gigabytes:
    each `1bIS2_S2_E` doubles the one it names)."""
    if isinstance(value, tuple):
        return f"{str(value[0])[:40]}<...>"
    return str(value)[:40]


def _traits(head: Any) -> Traits:
    """`Flash_fwd_kernel_traits`'s arguments as `_template_args` read them, checked: a head
    dim of `HEAD_DIMS`, a block and warps of positive ints, two bools, a named type."""
    if not (isinstance(head, tuple) and head[0] == "Flash_fwd_kernel_traits"
            and len(head[1]) >= 7):
        raise NameError_("its first template argument is not Flash_fwd_kernel_traits")
    d, m, n, w, qreg, share, elem = head[1][:7]
    if d not in HEAD_DIMS or type(d) is not int:
        raise NameError_(f"head dim {_shown(d)} is not one of {HEAD_DIMS}")
    if not all(type(v) is int and 0 < v <= 1024 for v in (m, n, w)):
        raise NameError_("kBlockM, kBlockN and kNWarps are not ints in 1..1024")
    if type(qreg) is not bool or type(share) is not bool or type(elem) is not str:
        raise NameError_("Is_Q_in_regs, Share_Q_K_smem or elem_type is not of its type")
    return Traits(d, m, n, w, qreg, share, DTYPES.get(elem, elem))


def _flags(kind: str, rest: list[Any]) -> tuple[int | bool, ...]:
    """A kind's own template arguments, checked against `FLAGS`: an int in its bounds for
    those of `INT_FLAGS`, a bool for the others."""
    names = FLAGS[kind]
    if len(rest) != len(names):
        raise NameError_(f"{len(rest)} template arguments, {kind} has {len(names)}")
    for flag, value in zip(names, rest, strict=True):
        low, high = INT_FLAGS.get(flag, (0, 0))
        ok = low <= value <= high if type(value) is int and flag in INT_FLAGS else \
            type(value) is bool and flag not in INT_FLAGS
        if not ok:
            want = f"an int in {low}..{high}" if flag in INT_FLAGS else "a bool"
            raise NameError_(f"{flag} {_shown(value)} is not {want}")
    return tuple(rest)


def parse(name: str) -> Kernel | None:
    """The kernel a mangled FA2 name is; None for a name of another family (not FA2's);
    NameError_ for a name of FA2's it cannot read, or whose arguments are not of the types
    and values FA2's have (`_traits`, `_flags`): a `Kernel` returned is one `derive` can
    work with."""
    prefix = "_ZN5flash"
    if not name.startswith(prefix):
        return None
    try:
        kind, at = _source_name(name, len(prefix))
        if kind not in FLAGS:
            return None
        subs: list[Any] = ["flash"]
        args, _ = _template_args(name, at, subs)
        if not args:
            raise NameError_("no template arguments")
        return Kernel(kind, _traits(args[0]), _flags(kind, args[1:]))
    except (IndexError, TypeError, ValueError) as exc:  # NameError_ is a ValueError
        raise NameError_(f"{name[:120]}: {exc}") from None


# --- 2. the dispatch ---------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    """What the dispatch reads of the GPU: the compute capability (is_sm8x), the shared
    memory per block (opt-in) and per SM (head dim 256's block), the SM count (the
    num_splits heuristic, used only when a case leaves num_splits to it)."""

    major: int
    minor: int
    smem_per_block: int
    smem_per_sm: int
    sms: int = 132


A100 = Gpu(8, 0, 166912, 167936, 108)
H100 = Gpu(9, 0, 232448, 233472, 132)
GB10 = Gpu(12, 1, 101376, 102400, 48)


@dataclass(frozen=True)
class Case:
    """One call of an op.  Every sequence of the batch has `seqlen_q` queries and
    `seqlen_k` keys (`fwd_kvcache`: a cache of `seqlen_k`, `cache_seqlens` of them used when
    `seqlens_k` is set; `append`: that many new keys appended).  `window`: (left, right),
    -1 for none.  `paged`: the block size of a paged cache (0: not paged).  `num_splits`:
    0 leaves it to the heuristic."""

    op: str
    dtype: str = "bfloat16"
    head_size: int = 128
    heads: int = 4
    heads_k: int = 4
    batch: int = 2
    seqlen_q: int = 128
    seqlen_k: int = 256
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    alibi: bool = False
    softcap: float = 0.0
    paged: int = 0
    num_splits: int = 1
    append: int = 0
    seqlens_k: bool = False
    p_dropout: float = 0.0
    return_softmax: bool = False

    @property
    def key(self) -> str:
        """The case's name in the harness's outputs: its shape (`b` batch, `h` heads x KV
        heads, `q` and `k` sequence lengths), then every other input that differs from the
        defaults, in field order (never one of the fixed cases' names, which have no
        shape)."""
        base = Case(self.op)
        parts = [self.dtype, f"d{self.head_size}", f"b{self.batch}",
                 f"h{self.heads}x{self.heads_k}", f"q{self.seqlen_q}", f"k{self.seqlen_k}"]
        for name in ("causal", "window", "alibi", "softcap", "paged", "num_splits", "append",
                     "seqlens_k", "p_dropout", "return_softmax"):
            value = getattr(self, name)
            if value != getattr(base, name):
                text = "x".join(map(str, value)) if isinstance(value, tuple) else \
                    ("" if value is True else str(value))
                parts.append(f"{name}{text}")
        return "-".join(parts)

    @property
    def name(self) -> str:
        """`OP/KEY`: the case's name among all ops' (the harness saves its outputs under
        it; two ops' cases may share a key)."""
        return f"{self.op}/{self.key}"


# the fixed cases harness_fa2.py runs first (its `varlen`, `kvcache`): dtype, head dim, and
# causal (varlen) or paged (kvcache)
VARLEN = [("bfloat16", 128, True), ("bfloat16", 128, False), ("float16", 64, True),
          ("bfloat16", 256, True), ("bfloat16", 96, True)]
KVCACHE = [("bfloat16", 128, False), ("bfloat16", 128, True), ("float16", 64, False)]


def fixed_cases() -> list[Case]:
    """The fixed cases as this model sees them (harness_fa2's `varlen`, `kvcache`: their
    shapes; the cache's num_splits left to the heuristic, as its `arguments` fills it, 0),
    so that the kernels they launch are not derived again."""
    return [*(Case("varlen_fwd", dtype=t, head_size=d, heads=16, heads_k=16, batch=1,
                   seqlen_q=1024, seqlen_k=1024, causal=c) for t, d, c in VARLEN),
            *(Case("fwd_kvcache", dtype=t, head_size=d, heads=16, heads_k=16, batch=2,
                   seqlen_q=1, seqlen_k=512, causal=True, paged=256 if p else 0,
                   num_splits=0, seqlens_k=True) for t, d, p in KVCACHE)]


def _head_dim(d: int) -> int:
    return next(h for h in HEAD_DIMS if d <= h)


def _fwd_traits(head_dim: int, causal: bool, dropout: bool, gpu: Gpu, dtype: str) -> Traits:
    """run_mha_fwd_hdim*: the non-split kernel's block for a head dim on this GPU."""
    sm8x = gpu.major == 8 and gpu.minor > 0
    block: tuple[int, int, int]
    if head_dim == 32:
        block = (128, 128, 4)
    elif head_dim == 64:
        block = (128, 64, 4) if dropout else (128, 128, 4)
    elif head_dim == 96:
        block = (64, 64, 4) if sm8x and causal else (128, 64, 4)
    elif head_dim == 128:
        block = (128, 32, 4) if dropout or (sm8x and not causal) else \
            (64, 64, 4) if sm8x else (128, 64, 4)
    elif head_dim == 192:
        block = (64, 64, 4) if dropout else (128, 64, 8)
    else:
        big = gpu.smem_per_block >= 2 * 256 * (128 + 2 * 64) and \
            gpu.smem_per_sm < 4 * 256 * (64 + 2 * 64)
        block = (128, 64, 8) if big else (64, 64, 4)
    return Traits(head_dim, block[0], block[1], block[2], False, False, dtype)


def _splitkv_traits(head_dim: int, dtype: str) -> Traits:
    """run_mha_fwd_splitkv_dispatch's block."""
    n = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    return Traits(head_dim, 64, n, 4, False, False, dtype)


def _heuristic(batch_nheads_mblocks: int, sms: int, n_blocks: int, max_splits: int) -> int:
    """flash_api.cpp's num_splits_heuristic."""
    if batch_nheads_mblocks >= 0.8 * sms:
        return 1
    max_splits = min(max_splits, sms, n_blocks)

    def ceildiv(a: int, b: int) -> int:
        return (a + b - 1) // b

    def eligible(s: int) -> bool:
        return s == 1 or ceildiv(n_blocks, s) != ceildiv(n_blocks, s - 1)

    eff = []
    for s in range(1, max_splits + 1):
        waves = batch_nheads_mblocks * s / sms
        eff.append(waves / math.ceil(waves) if eligible(s) else 0.0)
    best = max(eff, default=0.0)
    return next((s for s in range(1, max_splits + 1)
                 if eligible(s) and eff[s - 1] >= 0.85 * best), 1)


def invalid(case: Case) -> str | None:
    """Why the op refuses the case (its TORCH_CHECKs, and the harness's own limits), or
    None."""
    checks = [
        (case.op not in OPS + SPARSE_OPS, f"op {case.op} is not one the harness calls"),
        (case.dtype not in ("bfloat16", "float16"), "dtype must be bfloat16 or float16"),
        (not 0 < case.head_size <= 256, "head size must be 1..256"),
        (case.op == "varlen_fwd" and case.head_size % 8 != 0,
         "varlen_fwd: head size must be a multiple of 8"),
        (case.heads < 1 or case.heads_k < 1 or case.heads % case.heads_k != 0,
         "heads_k must divide heads"),
        (case.batch < 1 or case.seqlen_q < 1 or case.seqlen_k < 1, "empty batch or sequence"),
        (case.batch > MAX_BATCH or case.heads > MAX_HEADS or case.seqlen_q > MAX_SEQLEN
         or case.seqlen_k > MAX_SEQLEN, f"beyond the harness's bounds (batch {MAX_BATCH}, "
         f"heads {MAX_HEADS}, sequences of {MAX_SEQLEN})"),
        (case.batch * case.heads * max(case.seqlen_q, case.seqlen_k) * case.head_size
         > MAX_ELEMENTS, f"an input of over {MAX_ELEMENTS} elements (batch x heads x "
         "sequence x head size)"),
        (not all(-1 <= w <= MAX_SEQLEN for w in case.window),
         f"a window side is -1 (none) or 0..{MAX_SEQLEN}"),
        (not 0 <= case.softcap <= MAX_SOFTCAP, f"softcap must be in [0, {MAX_SOFTCAP:g}]"),
        (not 0 <= case.append <= MAX_SEQLEN, f"appended keys must be 0..{MAX_SEQLEN}"),
        (case.paged % 16 != 0 or case.paged < 0, "a paged block size is a multiple of 16"),
        (case.paged > 0 and case.seqlen_k % case.paged != 0,
         "the harness fills whole blocks: seqlen_k a multiple of the block size"),
        (case.num_splits > 128 or case.num_splits < 0, "num_splits must be 0..128"),
        (case.return_softmax and case.p_dropout <= 0,
         "return_softmax is only supported when p_dropout > 0"),
        (case.softcap > 0 and case.p_dropout > 0, "softcapping does not support dropout"),
        (not 0 <= case.p_dropout < 1, "p_dropout must be in [0, 1)"),
        (case.op == "fwd_kvcache" and (case.p_dropout > 0 or case.return_softmax),
         "fwd_kvcache has no dropout"),
        (case.op == "varlen_fwd" and (case.append or case.seqlens_k),
         "varlen_fwd appends no keys and takes no seqlens_k here"),
        (case.append and not case.seqlens_k, "appending keys needs seqlens_k"),
        (case.append and case.seqlen_q > case.seqlen_k,
         "appending keys needs seqlen_q <= the cache's seqlen"),
        (case.append and case.append >= case.seqlen_k,
         "the appended keys must fit in the cache"),
        (case.op in SPARSE_OPS and (case.window != (-1, -1) or case.paged > 0 or case.append
                                    or case.seqlens_k or case.num_splits not in (0, 1)),
         "the sparse ops take no window, paged cache, appended keys or splits"),
        (case.op in SPARSE_OPS and (case.head_size + 7) // 8 * 8 != SPARSE_TRAITS[0],
         "run_mha_fwd_sparse takes head dim 128 only (a head size of 121..128)"),
    ]
    return next((why for bad, why in checks if bad), None)


def _causal(case: Case) -> bool:
    """Causal as every op takes it: cleared for one query without ALiBi (causal and full
    are then the same; mha_*'s `is_causal = false`)."""
    return case.causal and not (case.seqlen_q == 1 and not case.alibi)


def launched(case: Case, gpu: Gpu) -> tuple[Kernel, ...]:
    """The kernels one call launches, in order; () where the op refuses the case."""
    if invalid(case) is not None:
        return ()
    if case.op in SPARSE_OPS:
        return (_sparse_kernel(case),)
    d = (case.head_size + 7) // 8 * 8
    head_dim = _head_dim(d)
    even_k = d == head_dim
    causal = _causal(case)
    wl, wr = case.window
    seqlen_q = case.seqlen_q
    if causal:
        wr = 0
    swapped = (seqlen_q == 1 and case.heads > case.heads_k and wl < 0 and wr < 0
               and case.p_dropout == 0 and d == case.head_size and not case.alibi)
    if swapped:
        seqlen_q = case.heads // case.heads_k
    seqlen_k = case.seqlen_k
    wl = -1 if wl >= seqlen_k else wl
    wr = -1 if wr >= seqlen_k else wr
    is_causal = wl < 0 and wr == 0  # set_params_fprop
    if wl < 0 <= wr:
        wl = seqlen_k
    if wl >= 0 > wr:
        wr = seqlen_k
    local = (wl >= 0 or wr >= 0) and not is_causal
    if case.op == "varlen_fwd":
        split_asked = swapped
        force_split = case.paged > 0
        cu_seqlens = True
    else:
        split_asked = True
        force_split = case.append > 0 or case.paged > 0
        cu_seqlens = case.seqlens_k
    num_splits = 0
    if split_asked and case.p_dropout == 0:
        num_splits = case.num_splits
        if num_splits < 1:
            n = 256 if d <= 64 else 128 if d <= 128 else 64
            num_splits = _heuristic(case.batch * case.heads * ((seqlen_q + 63) // 64),
                                    gpu.sms * 2, (seqlen_k + n - 1) // n, 128)
    dropout = case.p_dropout > 0
    softcap = case.softcap > 0
    if num_splits <= 1 and not force_split:
        t = _fwd_traits(head_dim, is_causal, dropout, gpu, case.dtype)
        even_mn = not cu_seqlens and seqlen_k % t.block_n == 0 and seqlen_q % t.block_m == 0
        ret = case.return_softmax
        return (Kernel("flash_fwd_kernel", t, (
            dropout and not softcap, is_causal, local and not is_causal, case.alibi,
            even_mn and even_k and not local and not case.alibi and not ret and head_dim <= 128,
            even_k and not ret and not case.alibi, softcap, ret and dropout and not softcap)),)
    t = _splitkv_traits(head_dim, case.dtype)
    even_mn = not cu_seqlens and seqlen_k % t.block_n == 0 and seqlen_q % t.block_m == 0
    append = case.append > 0
    split = num_splits > 1
    kernels = [Kernel("flash_fwd_splitkv_kernel", t, (
        is_causal, local and not is_causal, case.alibi,
        even_mn and not append and even_k and not local and not case.alibi and head_dim <= 128,
        even_k and not case.alibi, softcap, split, append))]
    if split:
        block_m = 4 if head_dim % 128 == 0 else 8 if head_dim % 64 == 0 else 16
        log = next(s for s in range(1, 8) if num_splits <= 1 << s)
        kernels.append(Kernel("flash_fwd_splitkv_combine_kernel", t, (block_m, log, even_k)))
    return tuple(kernels)


def _sparse_kernel(case: Case) -> Kernel:
    """run_flash_sparse_fwd's kernel: Is_local and Is_even_MN fixed false; Is_even_K true
    (the head dim is 128, the only one it takes); causal cleared for one query without
    ALiBi, as for the dense ops."""
    causal = _causal(case)
    dropout, softcap = case.p_dropout > 0, case.softcap > 0
    return Kernel("flash_fwd_sparse_kernel", Traits(*SPARSE_TRAITS, False, False, case.dtype), (
        dropout and not softcap, causal, False, case.alibi, False, True, softcap,
        case.return_softmax and dropout and not softcap))


# --- 3. the cases ------------------------------------------------------------------------

def _proposals(k: Kernel) -> list[Case]:
    """Cases meant to launch `k`, read back from its template arguments; `derive` keeps the
    first one `launched` confirms."""
    t = k.traits
    flags = dict(zip(FLAGS[k.kind], k.args, strict=True))
    even_k = flags.get("Is_even_K", True)
    below = HEAD_DIMS[HEAD_DIMS.index(t.head_dim) - 1] if t.head_dim > 32 else 0
    sizes = [t.head_dim] if even_k else [t.head_dim - 8] if t.head_dim - 8 > below else []
    if flags.get("Has_alibi") and not even_k:
        sizes = [t.head_dim, *sizes]  # alibi clears Is_even_K whatever the head size
    proto = Case("varlen_fwd", dtype=t.dtype, alibi=bool(flags.get("Has_alibi")),
                 softcap=30.0 if flags.get("Is_softcap") else 0.0,
                 causal=bool(flags.get("Is_causal")),
                 window=(32, 16) if flags.get("Is_local") else (-1, -1))
    out: list[Case] = []
    for size in sizes:
        base = replace(proto, head_size=size)
        if k.kind == "flash_fwd_kernel":
            dropout = bool(flags["Is_dropout"] or flags["Return_softmax"])
            if flags["Is_even_MN"]:  # fwd_kvcache without seqlens_k, whole blocks
                out.append(replace(base, op="fwd_kvcache", seqlen_q=t.block_m,
                                   seqlen_k=4 * t.block_n))
            out.append(replace(base, seqlen_q=t.block_m + 3, seqlen_k=2 * t.block_n + 5,
                               p_dropout=0.25 if dropout else 0.0,
                               return_softmax=bool(flags["Return_softmax"])))
            out.append(replace(base, op="fwd_kvcache", seqlen_q=t.block_m + 3,
                               seqlen_k=2 * t.block_n + 5, seqlens_k=True))
        elif k.kind == "flash_fwd_splitkv_kernel":
            splits = 3 if flags["Split"] else 1
            even = bool(flags["Is_even_MN"])
            q = t.block_m if even else t.block_m + 3
            append = 7 if flags["Append_KV"] else 0
            for paged in ((0,) if append or splits > 1 else (0, 16)):
                out.append(replace(base, op="fwd_kvcache", seqlen_q=q, seqlen_k=4 * t.block_n,
                                   num_splits=splits, append=append, paged=paged,
                                   seqlens_k=bool(append) or not even))
            if not even and not append:  # varlen_fwd: paged forces the split kernel
                out.append(replace(base, seqlen_q=q, seqlen_k=4 * t.block_n, paged=16,
                                   num_splits=splits))
        elif k.kind == "flash_fwd_sparse_kernel":  # both ops: causal ones varlen's
            dropout = bool(flags["Is_dropout"] or flags["Return_softmax"])
            out.append(replace(base, op="varlen_fwd_sparse" if flags["Is_causal"] else
                               "fwd_sparse", seqlen_q=t.block_m * 2 + 3,
                               seqlen_k=t.block_n * 3 + 5, p_dropout=0.25 if dropout else 0.0,
                               return_softmax=bool(flags["Return_softmax"])))
        elif k.kind == "flash_fwd_splitkv_combine_kernel":
            splits = 1 << flags["Log_max_splits"]
            out.append(Case("fwd_kvcache", dtype=t.dtype, head_size=size, seqlen_q=1,
                            seqlen_k=max(splits, 2) * t.block_n, num_splits=splits,
                            seqlens_k=True))
    return out


@dataclass
class Derived:
    """`derive`'s answer: the cases in order (those of `first` kept ahead), each with the
    kernels it is expected to launch; the kernels no case launches, and the names of FA2's
    `parse` refuses, each with why."""

    cases: list[Case] = field(default_factory=list)
    expects: dict[str, list[str]] = field(default_factory=dict)  # case name -> kernels
    unreachable: dict[str, str] = field(default_factory=dict)  # kernel name -> why
    foreign: list[str] = field(default_factory=list)  # names of no FA2 kind (not modeled)

    def dead(self) -> dict[str, str]:
        """The kernels no call of any op can launch on this GPU, each with the rule of the
        dispatch that never selects it (the rest of `unreachable` may be reachable)."""
        return {name: why for name, why in self.unreachable.items()
                if why != NOT_FOUND and not why.startswith(NOT_READ)}

    @property
    def covered(self) -> int:
        return len({n for names in self.expects.values() for n in names})

    def to_json(self) -> dict[str, Any]:
        return {"cases": [{**asdict(c), "key": c.key, "expects": self.expects[c.name]}
                          for c in self.cases],
                "covered": self.covered, "unreachable": self.unreachable,
                "foreign": self.foreign}


# the reasons `_why` gives that are not a rule of the dispatch: such a kernel may be
# reachable (by inputs the search did not find)
NOT_FOUND = "no case of the model (structured or searched) launched it"
NOT_READ = "not read as FA2's"


def _why(k: Kernel, gpu: Gpu) -> str:
    """Why no case launches `k`: the first rule of the dispatch it breaks."""
    t, flags = k.traits, dict(zip(FLAGS[k.kind], k.args, strict=True))
    if k.kind == "flash_fwd_sparse_kernel":
        return _why_sparse(t, flags)
    if flags.get("Is_dropout") and flags.get("Is_softcap"):
        return "Is_dropout with Is_softcap: run_flash_fwd clears Is_dropout under softcap"
    if k.kind == "flash_fwd_kernel":
        dropout = bool(flags["Is_dropout"])
        if flags["Return_softmax"] and not dropout:
            return "Return_softmax without Is_dropout: run_flash_fwd never instantiates it"
        for causal in (False, True):
            if _fwd_traits(t.head_dim, causal, dropout, gpu, t.dtype) == t:
                break
        else:
            return (f"head dim {t.head_dim} uses another block on this GPU (cc "
                    f"{gpu.major}.{gpu.minor}, {gpu.smem_per_block} B shared memory per "
                    f"block): {t.block_m}x{t.block_n} is picked on others "
                    f"(run_mha_fwd_hdim{t.head_dim}{', dropout' if dropout else ''})")
        if flags["Is_even_MN"] and (flags["Is_local"] or flags["Has_alibi"]
                                    or t.head_dim > 128 or not flags["Is_even_K"]):
            return "Is_even_MN is cleared by local, ALiBi, uneven K or head dim > 128"
        if flags["Is_even_MN"] and dropout:
            return "Is_even_MN needs no cu_seqlens: only fwd_kvcache, which has no dropout"
    if k.kind == "flash_fwd_splitkv_kernel":
        if t != _splitkv_traits(t.head_dim, t.dtype):
            return "not the block run_mha_fwd_splitkv_dispatch picks"
        if flags["Is_even_MN"] and (flags["Append_KV"] or flags["Is_local"]
                                    or flags["Has_alibi"] or t.head_dim > 128):
            return "Is_even_MN is cleared by Append_KV, local, ALiBi or head dim > 128"
    if flags.get("Is_even_K") and flags.get("Has_alibi"):
        return "Is_even_K is cleared by ALiBi"
    if flags.get("Is_causal") and flags.get("Is_local"):
        return "Is_local is cleared by Is_causal"
    return NOT_FOUND


def _why_sparse(t: Traits, flags: dict[str, Any]) -> str:
    """Why no case launches a sparse kernel: the rule of run_mha_fwd_sparse it breaks."""
    if (t.head_dim, t.block_m, t.block_n, t.warps) != SPARSE_TRAITS or t.q_in_regs \
            or t.share_qk:
        return "not the block run_mha_fwd_sparse_hdim128 picks (128, 64x64, 4 warps)"
    if not flags["Is_even_K"]:
        return ("Is_even_K false: run_mha_fwd_sparse takes head dim 128 only (a head size "
                "of 121..127 is padded to it), so is_even_K is always true")
    if flags["Is_even_MN"] or flags["Is_local"]:
        return "Is_even_MN and Is_local: run_flash_sparse_fwd fixes both false"
    if flags["Is_dropout"] and flags["Is_softcap"]:
        return "Is_dropout with Is_softcap: run_flash_sparse_fwd clears Is_dropout under softcap"
    if flags["Return_softmax"] and not flags["Is_dropout"]:
        return "Return_softmax without Is_dropout: run_flash_sparse_fwd never instantiates it"
    return NOT_FOUND


def _random_case(rng: random.Random, kinds: list[Kernel], dropout_built: bool) -> Case:
    """A case drawn from the inputs the added kernels' traits make worth trying (dropout
    only where the library has dropout kernels: a build without them refuses p > 0)."""
    t = rng.choice(kinds).traits
    op = rng.choice(OPS)
    q = rng.choice((1, 2, 7, 64, 128, 130))
    kv = rng.choice((1, 2, 4, 8)) * rng.choice((t.block_n, 64, 256)) + rng.choice((0, 0, 5))
    paged = rng.choice((0, 0, 16))
    if paged and kv % paged:
        kv += paged - kv % paged
    append = rng.choice((0, 0, 3)) if op == "fwd_kvcache" else 0
    dropout = dropout_built and op == "varlen_fwd" and rng.random() < 0.2
    heads_k = rng.choice((1, 2, 4))
    return Case(op, dtype=t.dtype, head_size=rng.choice((t.head_dim, t.head_dim - 8)),
                heads=heads_k * rng.choice((1, 2, 4)), heads_k=heads_k,
                batch=rng.choice((1, 2, 3)), seqlen_q=q, seqlen_k=kv,
                causal=rng.random() < 0.4,
                window=rng.choice(((-1, -1), (-1, -1), (16, 0), (32, 16), (-1, 8))),
                alibi=rng.random() < 0.25, softcap=rng.choice((0.0, 0.0, 30.0)) * (not dropout),
                paged=paged, num_splits=rng.choice((0, 1, 1, 2, 3, 5, 9, 17, 33, 65)),
                append=append, seqlens_k=op == "fwd_kvcache" and (bool(append) or
                                                                  rng.random() < 0.5),
                p_dropout=0.25 if dropout else 0.0,
                return_softmax=dropout and rng.random() < 0.5)


def derive(names: list[str], gpu: Gpu, *, first: list[Case] | None = None,
           budget: int = 20000, seed: int = 121) -> Derived:
    """Cases that launch every kernel of `names` some case can launch (see the module's
    docstring); `first`: cases kept ahead of the derived ones, in their order."""
    kernels: dict[Kernel, str] = {}
    out = Derived()
    refused: dict[str, str] = {}
    for name in names:
        try:
            k = parse(name)
        except NameError_ as exc:
            refused[name] = f"{NOT_READ}: {str(exc)[-160:]}"
            continue
        if k is None:
            out.foreign.append(name)
        else:
            kernels.setdefault(k, name)
    covered: set[Kernel] = set()

    def keep(case: Case, always: bool = False) -> bool:
        hits = [k for k in launched(case, gpu) if k in kernels]
        new = [k for k in hits if k not in covered]
        if (new or always) and case.name not in out.expects:
            out.cases.append(case)
            out.expects[case.name] = [kernels[k] for k in hits]
            covered.update(hits)
            return True
        return False

    for case in first or []:
        keep(case, always=True)
    for k in sorted(kernels):
        if k in covered:
            continue
        for case in _proposals(k):
            if k in launched(case, gpu):
                keep(case)
                break
    kinds = sorted(kernels)
    dropout_built = any(k.kind == "flash_fwd_kernel" and k.flag("Is_dropout") for k in kinds)
    rng = random.Random(seed)
    for _ in range(budget):
        if len(covered) == len(kernels) or not kinds:
            break
        keep(_random_case(rng, kinds, dropout_built))
    out.unreachable = {kernels[k]: _why(k, gpu) for k in sorted(kernels) if k not in covered}
    out.unreachable.update(refused)
    return out


def cases_from_json(data: Any) -> list[Case]:
    """Cases as `Derived.to_json` writes them (outside input: each field checked)."""
    return case_files.checked_cases(
        data, lambda item: Case(str(item.get("op", "")) if isinstance(item, dict) else ""),
        ("window",), invalid)


USAGE = "usage: fa2_kernels.py NAMES.txt [CC SMEM_BLOCK SMEM_SM]"


def main(argv: list[str]) -> int:
    """The derivation as JSON; a bad argument or file in one `usage:` line, exit 2."""
    return case_files.derivation_main(argv, USAGE, (H100, "two byte counts"), derive)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
