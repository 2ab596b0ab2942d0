"""Tile shapes and launch settings shared by the kernels and their schedule report.

One table per kernel family, chosen per head dim from sweeps on an H200 (`tilellm bench kernels
--sweep`). Keeping them here means the planner and the inspector's tile report describe exactly
the tiles the kernels visit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The kernels' softmax runs in base 2 (exp2 is one instruction): exp(x) = exp2(x * LOG2_E), and a
# base-2 log-sum-exp times LN_2 is the natural one.
LOG2_E = 1.4426950408889634  # 1 / ln 2
LN_2 = 0.6931471805599453


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per program (for paged: tokens x packed query heads)
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    # paged: gather K as [block_n, D] rows and transpose in the dot (else gathered as [D, block_n])
    k_rows: bool = False
    # prefill: "triton" (prefill.py, every GPU and the interpreter) or "gluon" (hopper.py,
    # sm_90 only: warp-specialised, ping-pong consumer warpgroups; causal calls only)
    kernel: str = "triton"


# `os.environ.get` costs about 1 us (it encodes the name and decodes the value), and an eager
# kernel call asks for TILELLM_DEBUG and TRITON_INTERPRET several times. CPython's `os.environ`
# keeps its entries in a dict of encoded names and values (`_data`); every write through
# `os.environ` (pytest's `monkeypatch.setenv` too) lands there, so reading it directly sees the
# same values.
_ENV_DATA: dict | None = getattr(os.environ, "_data", None)
if not (hasattr(os.environ, "encodekey") and hasattr(os.environ, "encodevalue")):
    _ENV_DATA = None  # another Python's os.environ: read it the usual way


@functools.cache
def _encoded(name: str, value: str) -> tuple:
    return os.environ.encodekey(name), os.environ.encodevalue(value)  # type: ignore[attr-defined]


def env_flag(name: str, value: str) -> Callable[[], bool]:
    """A function that says whether `os.environ.get(name) == value`, read on every call (tests
    switch these variables), with the encoded name and value made once."""
    if _ENV_DATA is None:
        return lambda: os.environ.get(name) == value
    key, want = _encoded(name, value)
    return lambda: _ENV_DATA.get(key) == want


_debug_flag = env_flag("TILELLM_DEBUG", "1")
_interpret_flag = env_flag("TRITON_INTERPRET", "1")


def debug_enabled() -> bool:
    """TILELLM_DEBUG=1: the kernels' value checks run on device tensors too, and keyed launches
    are checked against their keys."""
    return _debug_flag()


def interpreting() -> bool:
    """True when Triton runs under its CPU interpreter (small tiles keep it fast)."""
    return _interpret_flag()


# Launch arithmetic on the host, in plain Python: `triton.cdiv` and `triton.next_power_of_2` are
# Triton constexpr functions, about 2 us a call on the host, several times per eager launch.
def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for ints with b > 0 (as `triton.cdiv`)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, and 0 for 0 (as `triton.next_power_of_2`); any
    integer type (numpy's too)."""
    n = operator.index(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


SPLIT_MERGE_MODES = ("auto", "kernel", "separate")


@functools.cache
def split_merge_mode() -> str:
    """How `paged.py`'s split-KV calls merge their partials (`TILELLM_SPLIT_MERGE`).

    "auto" (the default): an eager call merges in the kernel itself (the last program of a tile
    to finish, `merge.merge_if_last`: one launch, which is what an eager call's host time is made
    of), with counters and partials of its stream's own; a call captured into a CUDA graph merges
    in a second launch (`merge.run_merge`). "kernel": in the kernel, captured calls too (with
    counters of the graph's own, zeroed at every replay: a memset more per call). "separate":
    always in a second launch."""
    mode = os.environ.get("TILELLM_SPLIT_MERGE", "auto")
    if mode not in SPLIT_MERGE_MODES:
        raise ValueError(f"TILELLM_SPLIT_MERGE={mode!r}: choose 'auto' (the default), 'kernel' or 'separate'")
    return mode


def fp8_verify_kernel() -> str:
    """Which kernel verifies a few new tokens a request over an FP8 cache on an H100/H200
    (`TILELLM_FP8_VERIFY`): "paged" (the default: `paged.py`'s FP8 tiles) or "gluon"
    (`decode_fp8.py`'s programs of 8 or 16 (token, head) columns). The Gluon form is opt-in: it
    passes its GPU tests, but measured faster than `paged.py` only on long contexts (V1-G2: 32
    requests x 8192 keys, 8 rows each, +38% on an H200) and 8-15% slower on the shorter ones of
    speculative decoding (docs/benchmarks.md, "Verification in the Gluon FP8 kernel").
    Read when a batch's shape is first planned (plans are kept per shape): set it before the
    first call, or call `paged.clear_plans()` after changing it."""
    kernel = os.environ.get("TILELLM_FP8_VERIFY", "paged")
    if kernel not in ("paged", "gluon"):
        raise ValueError(f"TILELLM_FP8_VERIFY={kernel!r}: choose 'paged' (the default) or 'gluon'")
    return kernel


def fp8_verify_uses_gluon(head_dim: int, dtype: torch.dtype, group: int, max_seqlen_q: int) -> bool:
    """Whether a verification batch over an FP8 cache (`max_seqlen_q` new tokens a request at
    most) runs `decode_fp8.py`: with TILELLM_FP8_VERIFY=gluon, where `decode_fp8_uses_gluon`
    takes its shape."""
    return fp8_verify_kernel() == "gluon" and decode_fp8_uses_gluon(head_dim, dtype, group, max_seqlen_q)


@functools.cache
def rope_store_fused() -> bool:
    """Whether an attention layer with its rotary embedding rotates q and k and stores K/V into
    the paged cache in one launch (`apply_rotary` with the cache arguments: the default, or
    `TILELLM_ROPE_STORE=fused`) rather than in two (`TILELLM_ROPE_STORE=separate`)."""
    mode = os.environ.get("TILELLM_ROPE_STORE", "fused")
    if mode not in ("fused", "separate"):
        raise ValueError(f"TILELLM_ROPE_STORE={mode!r}: choose 'fused' (the default) or 'separate'")
    return mode == "fused"


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 products for fp32 inputs (TF32 would cost ~1e-3
    relative error in the scores, which large logits amplify); native for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def prefill_config(
    head_dim: int, dtype: torch.dtype, max_seqlen: int = 1 << 30, *, v_head_dim: int | None = None
) -> TileConfig:
    """Tiles for `prefill_attention`, from H200 sweeps (`tilellm bench kernels --sweep`).

    `head_dim` is q's and k's (Dqk), `v_head_dim` v's (Dv, default: the same).
    Head dims 65-128 in half precision: 128x64 tiles, 4 warps, 2 stages. One program then
    needs little enough shared memory and registers for two to share an SM, and one's softmax
    runs while the other's matmuls do (P1 456 vs 424 TFLOP/s for 128x128 tiles of
    8 warps and 3 stages, one program per SM; the same pick as the Triton tutorial's autotuner).
    Batches of short requests (<= 1024 tokens): 64x64 tiles, so fewer rows of each request's last
    query tile are wasted (P3 284 vs 277 TFLOP/s). Longer batches on an H100/H200 with
    Dqk = Dv = 128: the Gluon kernel of `hopper.py` (128x128 tiles, two consumer warpgroups + a
    producer warp, 3 K/V stages); `kernel` says which, and causal=False calls take the Triton
    kernel with the same tiles. Unequal head dims, and dims that are not powers of two, always
    take the Triton kernel (`hopper.py` serves one power-of-two head dim for q, k and v).
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    widest = max(head_dim, v_head_dim)
    if "prefill" in _overrides:
        return _overrides["prefill"]
    if interpreting():
        return TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if 128 < head_dim <= 192 and v_head_dim <= 128:
        # MLA's prefill (Dqk 192 = 128 + 64, Dv 128), not yet timed: FlashAttention-2's tiles for
        # head dim 192 (128x64, 8 warps). Built for sm_90a: 254 registers, no stack, 129 KB of
        # shared memory (Q 48 KB + 2 stages of K 48 KB and V 32 KB), so one program per SM; the
        # same tiles with 4 warps spill (336 B of stack); 64x64 tiles of 4 warps (242 registers,
        # 105 KB, two programs per SM) are the alternative to time against it.
        return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    if widest > 128:
        return TileConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if max_seqlen <= 1024:
        return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    if head_dim == 128 and v_head_dim == 128 and gluon_ok():
        # H200: P1 480 / P2 607 TFLOP/s against 455 / 536 for the Triton kernel
        # (and cuDNN's 457 / 595); for P3's short requests the Triton kernel stays ahead (283 vs 243)
        return TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, kernel="gluon")
    if widest <= 64:
        return TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)


GLUON_QUERY_TILE = 128  # query tokens per program of the Gluon kernels: two consumer warpgroups of 64
GLUON_KEY_TILE = 128  # keys per K/V tile of the Gluon kernels (their launchers' default)
GLUON_CHUNK_MIN_TOKENS = 128  # one full query tile of the Gluon kernel
GLUON_MEAN_MIN_TOKENS = 64  # new tokens per request on average: chunks, not verification


def gluon_page_ok(page: int) -> bool:
    """Pages the Gluon paged kernel can copy: 16-key multiples that tile its 128-key slots
    exactly (a divisor of 128, or a multiple of it), so every TMA box starts on a page."""
    return page % 16 == 0 and (128 % page == 0 or page % 128 == 0)


DECODE_FP8_MAX_ROWS = 64  # query rows (new tokens x a group's heads) a request, for decode_fp8.py


def decode_fp8_uses_gluon(head_dim: int, dtype: torch.dtype, group: int, max_seqlen_q: int = 1) -> bool:
    """Whether decode batches, and verification batches of a few new tokens, over an FP8 cache
    run the Gluon kernel of `decode_fp8.py` (no shared-memory round trip of widened tiles; on an
    H200 E1's decode step 3529 vs 3129 GB/s of FP8 bytes, D4 3485 vs 3154: docs/benchmarks.md):
    an H100/H200, half-precision queries, head dim 64 or 128, at most 8 query heads per KV head,
    at most DECODE_FP8_MAX_ROWS query rows a request (its new tokens x the group's heads, in
    programs of 8 or 16 MMA columns), no forced tiles."""
    return (
        "paged" not in _overrides
        and gluon_module_ok("decode_fp8")
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim in (64, 128)
        and group <= 8
        and max(max_seqlen_q, 1) * group <= DECODE_FP8_MAX_ROWS
    )


def paged_uses_gluon(
    head_dim: int,
    dtype: torch.dtype,
    page: int,
    max_seqlen_q: int,
    programs: int,
    *,
    num_tokens: int | None = None,
    num_requests: int | None = None,
    num_sms_: int | None = None,
) -> bool:
    """Whether `paged_attention` runs the Gluon kernel of `hopper.py` (prompt chunks over a
    cached prefix; on an H200 C1 557-618 TFLOP/s against 347 for the Triton
    kernel, and 515 vs 272 for 32 chunks of 128 tokens over 2048 cached).

    On an H100/H200, for D = 128 in half precision, pages that tile a 128-key slot
    (`gluon_page_ok`), batches with a chunk of at least one full 128-token query tile and at
    least 64 new tokens per request on average (its programs hold one query head's 128 tokens:
    a batch of mostly short verifications is cheaper packed by `paged.py`), and enough programs
    (query tiles x query heads x requests, an upper bound) for a wave on every SM: that kernel
    has no split-KV, so a batch that needs splitting stays on `paged.py`.
    """
    if "paged" in _overrides:
        return False
    chunky = num_tokens is None or num_requests is None or num_tokens >= GLUON_MEAN_MIN_TOKENS * num_requests
    return (
        gluon_ok()
        and head_dim == 128
        and dtype in (torch.bfloat16, torch.float16)
        and gluon_page_ok(page)
        and max_seqlen_q >= GLUON_CHUNK_MIN_TOKENS
        and chunky
        and programs >= (num_sms_ or num_sms())
    )


def paged_config(
    head_dim: int, dtype: torch.dtype, group: int, max_seqlen_q: int, *, kv_fp8: bool = False
) -> tuple[TileConfig, int]:
    """Tiles for `paged_attention` and the query tokens per tile (`block_q`); `kv_fp8`: an FP8
    cache (half the bytes per key row).

    The query heads that share a KV head are packed into the rows of one tile, so a tile holds
    `block_q` tokens x `group` heads; decode (one token) still gives the tensor cores >= 16 rows.
    """
    k_rows = False
    if "paged" in _overrides:
        o = _overrides["paged"]
        rows, block_n, warps, stages, k_rows = o.block_m, o.block_n, o.num_warps, o.num_stages, o.k_rows
    elif interpreting():
        rows, block_n, warps, stages = 16, 16, 4, 1
    elif max_seqlen_q * group <= 16 and kv_fp8 and head_dim <= 128:
        # Decode over an FP8 cache: half the bytes per key, so narrower key tiles of one warp, six
        # deep (H200 sweep of D1: 3819 GB/s of FP8 bytes, 1.74x the bf16 kernel's tokens/s; the
        # bf16 cache's tiles reach 2944 GB/s there).
        rows, block_n, warps, stages = 16, 32, 1, 6
    elif max_seqlen_q * group <= 16:
        # Decode: 2 warps per 16-row tile (E1D sweep: 18% over 4 warps).
        rows, block_n, warps, stages = 16, 64 if head_dim <= 128 else 32, 2, 3
    elif max_seqlen_q * group <= 64:
        # Verification-sized tiles: 128-key tiles (V1 sweep: 3657 vs 3089 GB/s).
        rows, block_n, warps, stages = 64, 128 if head_dim <= 128 else 32, 4, 3
    else:
        # Chunks: 128 rows of 4 warps, 64-key tiles three deep (C1 over three
        # measurements: 359 TFLOP/s on average; 352 for 32-key tiles four deep, 360 for 256-row tiles of 8
        # warps, which waste twice the rows on a short chunk's last tile; ~300 for 128-key tiles
        # of 8 warps). It needs 128 KB of shared memory: GPUs with less (~99 KB on sm_86/89)
        # get the 32-key tile (96 KB).
        if head_dim > 128:
            rows, block_n, warps, stages = 64, 32, 4, 2
        elif max_shared_memory() >= 160 * 1024:
            rows, block_n, warps, stages = 128, 64, 4, 3
        else:
            rows, block_n, warps, stages = 128, 32, 4, 4
    if dtype == torch.float32 and not interpreting():
        rows, block_n = min(rows, 64), min(block_n, 32)
    block_q = max(1, rows // group)
    block_q = 1 << (block_q.bit_length() - 1)  # power of two tokens per tile
    block_q = min(block_q, _next_pow2(max(1, max_seqlen_q)))
    block_m = max(16, _next_pow2(block_q * group))
    if "paged" in _overrides:
        # a forced tile keeps its rows even where fewer would do (decode tiles of 64 rows, say,
        # which Triton runs on warpgroup MMAs: benchmarks sweep them); the extra rows are masked
        block_m = max(block_m, _next_pow2(rows))
    cfg = TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, k_rows=k_rows)
    return cfg, block_q


def _next_pow2(x: int) -> int:
    return next_power_of_2(max(1, x))


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int | None = None) -> int:
    """Streaming multiprocessors of the current CUDA device; 132 (an H100/H200) elsewhere.

    Off the GPU the nominal count keeps the split-KV plan deterministic for tests and the
    inspector.
    """
    if torch.cuda.is_available() and not interpreting():
        idx = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(idx).multi_processor_count
    return 132


@functools.lru_cache(maxsize=8)
def hopper(device_index: int | None = None) -> bool:
    """True on an sm_90 GPU (H100/H200) outside the interpreter: the Gluon kernels' target."""
    if torch.cuda.is_available() and not interpreting():
        idx = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_capability(idx) == (9, 0)
    return False


_gluon_disabled: str | None = None  # why the Gluon kernels cannot be built here (None: not known)


def gluon_unavailable() -> str | None:
    """Why `hopper.py`'s Gluon kernels cannot be used with the installed Triton, or None.

    Importing them needs Triton's Gluon dialect with its Hopper module; building them needs the
    names `hopper.py` uses (they moved between releases: see its aliases). A failure of either
    is recorded once, logged once, and from then on the dispatch runs the portable Triton kernels
    (`prefill.py`, `paged.py`) instead.
    """
    global _gluon_disabled
    if _gluon_disabled is None:
        try:
            from tilellm.kernels import hopper  # noqa: F401
        except Exception as e:  # ImportError, AttributeError: a Triton without the names we use
            disable_gluon(f"{type(e).__name__}: {e}")
    return _gluon_disabled or None


def disable_gluon(reason: str) -> None:
    """Record that the Gluon kernels cannot be built here (`reason`), and say so once."""
    global _gluon_disabled
    if not _gluon_disabled:
        import triton

        logger.warning(
            "Gluon kernels unavailable on Triton %s (%s): Hopper runs the portable Triton kernels",
            triton.__version__,
            reason.splitlines()[0] if reason else "unknown",
        )
    _gluon_disabled = reason or "unknown"


# Gluon modules besides hopper.py that cannot be built here, and why
_gluon_module_disabled: dict[str, str] = {}


def launch_gluon(launch: Callable[[ModuleType], bool | None], module: str = "hopper") -> bool:
    """Run `launch(kernels)`, a launch of one of the Gluon kernels of `tilellm.kernels.<module>`
    (`hopper.py`, `decode_fp8.py`, `fp8_gemm_hopper.py`); False when `launch` returns False (it did not take the
    batch), or when the installed Triton cannot build it: the caller then runs the portable
    kernel. A `hopper.py` compile failure disables every Gluon kernel from then on
    (`disable_gluon`); another module's failure to import or build (its names moved between
    Triton releases) disables that module alone, with one warning. Errors of the launch itself
    (CUDA, shapes) propagate."""
    import importlib

    from triton.compiler.errors import CompilationError

    if gluon_unavailable() is not None or module in _gluon_module_disabled:
        return False
    try:
        taken = launch(importlib.import_module(f"tilellm.kernels.{module}"))
    except (CompilationError, ImportError, AttributeError, TypeError) as e:
        if module == "hopper" and not isinstance(e, CompilationError):
            raise
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        if module == "hopper":
            disable_gluon(reason)
        else:
            import triton

            logger.warning("Gluon kernels of %s unavailable on Triton %s (%s): the portable kernel runs", module,
                           triton.__version__, reason)  # fmt: skip
            _gluon_module_disabled[module] = reason
        return False
    return taken is not False


def gluon_module_ok(module: str) -> bool:
    """Whether `tilellm.kernels.<module>`'s Gluon kernels can run here (an sm_90 GPU, a Triton
    that builds Gluon, and no failure of this module so far)."""
    return gluon_ok() and module not in _gluon_module_disabled


def compile_gluon_for_sm90(
    fn: Any,
    args: dict[str, Any],
    consts: dict[str, Any],
    options: dict[str, int],
    divisible_by_16: Iterable[str] = (),
) -> Any:
    """Compile the Gluon kernel `fn` for sm_90a without a GPU (Triton ships its own ptxas), to read
    its PTX / SASS anywhere; the kernels' `compile_for_sm90` name their arguments here. `args`:
    example values naming the signature (tensors, descriptors, numbers); `consts`: the
    constexprs; `divisible_by_16`: the arguments compiled as 16-byte aligned / divisible by 16,
    as the engine's launches specialise them. Run outside the Triton interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else mangle_type(args[n]) for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def gluon_ok(device_index: int | None = None) -> bool:
    """True where the Gluon kernels run: an sm_90 GPU and a Triton that builds them."""
    return hopper(device_index) and gluon_unavailable() is None


@functools.lru_cache(maxsize=8)
def max_shared_memory(device_index: int | None = None) -> int:
    """Bytes of shared memory one program may use on the current CUDA device; an H100/H200's
    227 KB elsewhere (keeps the tile table, and so the schedule report, deterministic off-GPU)."""
    if torch.cuda.is_available() and not interpreting():
        idx = torch.cuda.current_device() if device_index is None else device_index
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    return 227 * 1024


_overrides: dict[str, TileConfig] = {}


def overridden() -> bool:
    """Whether `override` forces a tile config now (planners then skip their per-shape caches)."""
    return bool(_overrides)


@contextlib.contextmanager
def override(**configs: TileConfig) -> Iterator[None]:
    """Force tile configs for a block of code (benchmark sweeps): `override(prefill=TileConfig(...))`.

    Keys: "prefill", "paged". For "paged", block_m is the row count before packing.
    """
    saved = dict(_overrides)
    _overrides.update(configs)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
