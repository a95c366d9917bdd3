"""Guarded Triton import: `import lightllm.kernels` must work where Triton is missing.

Without Triton the `@triton.jit` kernels are still defined (so the modules import and the
torch references stay usable) but calling one raises a clear error.
"""
import collections
import functools
import logging
import time

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _MissingTriton:
        """Stands in for both `triton` and `triton.language` when Triton is not installed."""

        constexpr = None  # only used as an annotation

        @staticmethod
        def jit(fn=None, **_kwargs):
            def unavailable(*_args, **_kw):
                raise RuntimeError("Triton is not installed; use the *_ref torch functions")

            return unavailable if fn is not None else (lambda f: unavailable)

        def __getattr__(self, name):
            raise RuntimeError(f"Triton is not installed (needed for triton.{name})")

    triton = tl = _MissingTriton()
    logger.info("triton not importable: kernels fall back to the torch references")

LOG2E = 1.4426950408889634  # attention kernels use exp2: exp(x) = exp2(x * LOG2E)

# Triton releases whose private launcher (`CompiledKernel.run`'s arguments, which `_Direct` calls)
# was checked: 3.6 on the H100, 3.9 on the CPU machine; requirements.txt bounds triton to them.
TESTED_TRITON = ((3, 6), (3, 9))


def _tested_triton(version: str) -> bool:
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return TESTED_TRITON[0] <= major_minor <= TESTED_TRITON[1]


# Launch through `fast_launch` (below) rather than Triton's own per-call path, on the tested
# releases only: set False to time the difference (test/benchmark/engine/profile_step.py's eager rows).
FAST_LAUNCH = HAS_TRITON and _tested_triton(triton.__version__)
if HAS_TRITON and not FAST_LAUNCH:
    logger.warning("triton %s is outside the tested %s: kernels launch through Triton's own (slower) path",
                   triton.__version__, " to ".join(".".join(map(str, v)) for v in TESTED_TRITON))


def _launch_key(args: tuple) -> tuple:
    """What Triton's compiled kernel depends on, per argument, and a little more (so a key that
    matches never picks a kernel compiled for other argument properties): a tensor's dtype and
    16-byte alignment; an int's == 1, divisibility by 16 and width; a float's type. One loop with
    plain type tests, no call per argument: this runs for every argument of every launch (a
    quarter faster than a function mapped over them)."""
    key = []
    add = key.append
    for arg in args:
        kind = type(arg)
        if kind is int:
            add((arg == 1, not arg & 15, -(1 << 31) <= arg < (1 << 31), arg < (1 << 63)))
        elif kind is float:
            add(float)
        elif kind is bool:
            add((bool, arg))
        elif kind is torch.Tensor or hasattr(arg, "data_ptr"):
            add((arg.dtype, not arg.data_ptr() & 15))
        else:
            add((kind, arg))
    return tuple(key)


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for the host: Triton's is a constexpr_function that unwraps its arguments, 5 us
    a call on the H100 hosts, a few hundred calls in an eager step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for the host (see cdiv): the smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def _current_stream(device_index: int) -> int:
    """The raw CUDA stream Triton itself launches on (its driver asks torch the same way): the
    capture stream while a CUDA graph is being captured."""
    return torch._C._cuda_getCurrentRawStream(device_index)


class _Direct:
    """A compiled kernel's launcher, called as Triton's `CompiledKernel[grid](...)` does but with
    what that wrapper looks up on every call (device, stream, launch metadata, hooks) looked up
    once: about 14 of a launch's 64 us of host time on the H100 hosts. Kernels without those
    attributes (another Triton version) launch through `kernel[grid]`."""

    __slots__ = ("run", "function", "metadata", "constexprs")

    def __init__(self, kernel, constexprs: tuple):
        self.run, self.function = kernel.run, kernel.function
        self.metadata, self.constexprs = kernel.packed_metadata, constexprs

    @staticmethod
    def of(kernel, constexprs: tuple):
        if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            return _Direct(kernel, constexprs)
        return lambda grid, args, device: kernel[grid](*args, *constexprs)

    def __call__(self, grid, args, device):
        self.run(grid[0], grid[1], grid[2], _current_stream(device), self.function, self.metadata, None, None, None,
                 *args, *self.constexprs)


# Launches that took Triton's own path because their specialisation was new to this process, their
# host time and their kernels' names: where Triton compiled a kernel or loaded it from its disk
# cache. The step trace records them per step (lightllm/engine/step_trace.py): a serving step
# should show none. A kernel's constexprs that follow a step's shape make one such kernel per new
# value: decode attention's plan in eager steps compiled 0.3-0.6 s while serving on an H200 until
# those steps took their graph bucket's plan (2026-12-02).
NEW_SPECIALISATIONS = {"launches": 0, "ms": 0.0, "kernels": []}

# Every kernel Triton compiles in the process, ours and other libraries' (flash-linear-attention's,
# their autotuners' candidates included), from Triton's post-compile hook: the step trace names
# those of each launch, where NEW_SPECIALISATIONS sees only ours. The names kept are the last 256.
COMPILES: dict = {"count": 0, "kernels": collections.deque(maxlen=256)}


def count_compile(*, fn=None, **_) -> None:
    """Triton's jit_post_compile_hook (keywords key, repr, fn, compile, is_manual_warmup,
    already_compiled): one more compilation of `fn`. Returns None: Triton goes on as without it."""
    COMPILES["count"] += 1
    COMPILES["kernels"].append(getattr(fn, "name", "?"))


def count_compiles() -> None:
    """Install count_compile, where Triton has the hook (3.4 on) and nothing else holds it."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None) if HAS_TRITON else None
    if runtime is not None and getattr(runtime, "jit_post_compile_hook", count_compile) is None:
        runtime.jit_post_compile_hook = count_compile


class _FastKernel:
    """`kernel[grid](*args, **constexprs_and_options)` as Triton's JIT launch, minus its per-call
    binding: Triton specialises and hashes every argument on every call (25-50 us of Python on the
    H100 hosts, about 250 launches per eager step: 6-13 ms of its host time). The first call with
    a given specialisation goes through Triton (which compiles and launches) and its compiled
    kernel is kept; later calls launch that kernel directly. CUDA tensors only: elsewhere (the
    interpreter, which the CPU tests use) every call goes through Triton."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = list(getattr(fn, "arg_names", ()))
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        first = args[0]
        if not FAST_LAUNCH or not getattr(first, "is_cuda", False):
            return self.fn[grid](*args, **kwargs)
        key = (_launch_key(args), tuple(kwargs.items()))
        launch = self._compiled.get(key)
        if launch is None:
            start = time.perf_counter()
            kernel = self.fn[grid](*args, **kwargs)
            NEW_SPECIALISATIONS["launches"] += 1
            NEW_SPECIALISATIONS["ms"] += (time.perf_counter() - start) * 1000
            NEW_SPECIALISATIONS["kernels"].append(self.fn.__name__)
            # The compiled kernel takes every parameter in order, constexprs included; they are
            # part of the key, so fixed for it.
            self._compiled[key] = _Direct.of(kernel, tuple(kwargs[n] for n in self.arg_names[len(args):]))
            return None
        launch(tuple(grid) + (1,) * (3 - len(grid)), args, first.get_device())
        return None


def fast_launch(fn):
    """Decorator for @triton.jit kernels launched from Python (not for helpers called by kernels)."""
    return _FastKernel(fn) if HAS_TRITON else fn


@functools.cache
def use_descriptor_allocator(device: torch.device) -> None:
    """Kernels that build tensor descriptors on the device (TMA loads) keep them in global scratch,
    which Triton's launcher takes, per launch, from the allocator set here: torch's caching
    allocator on the current stream (a captured graph's pool during capture), freed at once and so
    reused only by later work on the same stream. The interpreter needs none."""
    if device.type == "cuda":
        triton.set_allocator(lambda size, _alignment, _stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device, elsewhere: int = 1) -> int:
    """The device's streaming multiprocessors (what a wave of programs fills); `elsewhere` for a
    CPU tensor (the interpreter, where any launch plan is correct)."""
    if device.type != "cuda":
        return elsewhere
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())



# Where torch cannot say: the opt-in limit of sm86/sm89 (99 KiB), the smallest of the GPUs served.
DEFAULT_SHARED_BYTES = 101376


@functools.cache
def _shared_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", DEFAULT_SHARED_BYTES)


def shared_memory_limit(device: torch.device) -> int | None:
    """The most shared memory one program may take on `device` (opted in: 232448 bytes on an H100
    or H200), which Triton checks at launch; None for a CPU tensor (the interpreter has none)."""
    if device.type != "cuda":
        return None
    return _shared_limit(device.index if device.index is not None else torch.cuda.current_device())


def attention_shared_bytes(block_m: int, block_n: int, stages: int, block_d: int, q_bytes: int, kv_bytes: int) -> int:
    """What an attention program keeps in shared memory: its Q tile and `stages` buffers of a K and
    a V tile in the cache's element size (the pipelined loads; an fp8 cache is widened in registers).
    Triton 3.9's sm90 compiles take exactly this for extend attention (393216 bytes for Q 128 x 512
    and two stages of K and V 64 x 512 in bf16, what an H200 refused for Gemma 4's global layers;
    196608 at 64 x 32, bf16 or 131072 over fp8) and less for decode attention (82944 against
    147456 at 16 x 32 x 512), whose gathered loads it pipelines less: an upper bound there."""
    return block_d * (block_m * q_bytes + 2 * block_n * stages * kv_bytes)


def fit_attention_launch(block_m: int, block_n: int, stages: int, block_d: int, q_bytes: int, kv_bytes: int,
                         limit: int | None, min_block_m: int) -> tuple[int, int, int]:
    """(block_m, block_n, stages) as given, or shrunk until attention_shared_bytes fits `limit`
    (None: no limit): the key block to 32, then the query block to min_block_m (a divisor of it:
    the caller's block tables stay valid), then the stages, then both blocks to 16. Keeps the
    tuned launch wherever it fits (the head sizes it was tuned for)."""
    def fits(m, n, s):
        return limit is None or attention_shared_bytes(m, n, s, block_d, q_bytes, kv_bytes) <= limit

    while not fits(block_m, block_n, stages):
        if block_n > 32:
            block_n //= 2
        elif block_m > max(min_block_m, 64):
            block_m //= 2
        elif stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > max(min_block_m, 16):
            block_m //= 2
        else:
            raise ValueError(f"no attention launch for head size {block_d} fits {limit} bytes of shared memory")
    return block_m, block_n, stages


_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def zeroed_counters(owner: str, size: int, device: torch.device) -> torch.Tensor:
    """`owner`'s int32 counters on `device`, zero between launches: a kernel whose programs count
    themselves done (the last one then finishes the work: decode attention's merge, the split-K
    GEMM's sum) sets its counters back before it ends. Made at the first call on the device, which
    must run before any CUDA graph capture (cuda_graph.py warms every bucket up first): made
    inside a capture, the buffer would belong to that graph's memory pool."""
    counters = _COUNTERS.get((owner, device))
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run it once outside CUDA graph capture first")
        counters = _COUNTERS[owner, device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters


# Programmatic dependent launch (sm90+): a kernel launched with it may be scheduled while the
# kernel ahead of it in the stream is still finishing, and waits (grid_dependency_wait) before it
# reads that kernel's output; in a decode step this overlaps the launch of the norms, rotary,
# attention and the gated activation with the tail of the GEMM or kernel before them. False
# launches them as ordinary kernels (test/benchmark/engine/profile_step.py times the difference).
USE_PDL = True


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """An NVIDIA device's compute capability; (0, 0) under ROCm, whose numbering differs and whose
    compiler takes no PTX."""
    return (0, 0) if torch.version.hip else torch.cuda.get_device_capability(device_index)


def pdl(t: torch.Tensor) -> dict:
    """Launch options for a kernel whose every program calls grid_dependency_wait(PDL) before it
    reads what earlier kernels wrote: programmatic dependent launch for CUDA tensors on sm90+."""
    if USE_PDL and t.is_cuda and _capability(t.device.index if t.device.index is not None
                                             else torch.cuda.current_device())[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def grid_dependency_wait(PDL: tl.constexpr):
    """Wait until the kernel ahead in the stream has finished and its writes are visible (PTX
    griddepcontrol.wait; a no-op in a kernel launched without PDL). Loads of what the host or
    older kernels wrote may come before it; nothing that kernel writes or reads may."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the kernel after this one (if launched with PDL) be scheduled now rather than when this
    one's programs end (PTX griddepcontrol.launch_dependents): its programs run up to their own
    grid_dependency_wait beside this kernel's, which still finishes before they pass it."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST (set for CPU tensors, i.e. under TRITON_INTERPRET)
    multiplies in fp32 because the interpreter multiplies bf16 blocks as their raw uint16 bits."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")  # ieee only affects fp32 inputs: no TF32 rounding


def score_scale(sm_scale: float, softcap: float) -> float:
    """What attend_kv_block multiplies q.k by: sm_scale in log2 units, or with a soft cap (Gemma 2)
    the argument of its tanh, sm_scale / softcap (the kernel applies LOG2E after the cap)."""
    return sm_scale / softcap if softcap else sm_scale * LOG2E


@triton.jit
def attend_kv_block(q, m_i, l_i, acc, k_ptr, v_ptr, token_row, cols, col_mask, allowed, kv_head, dims, dim_mask,
                    k_slot_stride, k_head_stride, v_slot_stride, v_head_stride, qk_scale,
                    DOT_UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, UNSEEN: tl.constexpr):
    """One step of the online softmax over a block of keys gathered through the token table:
    the queries' running max m_i, sum l_i and output acc, updated with keys `cols` (valid where
    col_mask) where `allowed` [rows, cols] lets a query see a key. Shared by the attention kernels.
    qk_scale is score_scale(sm_scale, SOFTCAP); SOFTCAP > 0 caps each score at +-SOFTCAP with tanh.
    UNSEEN: a query may have seen no key yet after this block (its m_i still -inf); it then keeps
    l_i = 0 and acc = 0 rather than NaN."""
    slots = tl.load(token_row + cols, mask=col_mask, other=0).to(tl.int64)  # entries past the length may be unset
    # K/V in the queries' dtype: an fp8 cache (--kv_cache_dtype fp8_e4m3) is widened here, as it is read
    k = tl.load(k_ptr + slots[None, :] * k_slot_stride + kv_head * k_head_stride + dims[:, None],
                mask=col_mask[None, :] & dim_mask[:, None], other=0.0).to(q.dtype)
    scores = dot(q, k, DOT_UPCAST) * qk_scale
    if SOFTCAP > 0:  # tanh(x) = 2 sigmoid(2x) - 1
        scores = (SOFTCAP * 1.4426950408889634) * (2.0 * tl.sigmoid(2.0 * scores) - 1.0)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = m_new
    if UNSEEN:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    v = tl.load(v_ptr + slots[:, None] * v_slot_stride + kv_head * v_head_stride + dims[None, :],
                mask=col_mask[:, None] & dim_mask[None, :], other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def sink_weight(sinks_ptr, heads, head_mask, m_i, SINKS: tl.constexpr):
    """exp2(sink * LOG2E - m_i) per head: an attention sink's share of a softmax whose running max
    (log2 units, attend_kv_block's) is m_i, added once to its sum; 0 without sinks."""
    weight = tl.zeros_like(m_i)  # one return of one type: Triton's compiler refuses a scalar beside a tensor
    if SINKS:
        weight = tl.exp2(tl.load(sinks_ptr + heads, mask=head_mask, other=float("-inf")) * 1.4426950408889634 - m_i)
    return weight


def fp8_dot_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype an attention kernel's dots run in: q's, except over an fp8 (e4m3) cache with bf16
    queries, where K/V widen to fp16 and q is rounded to it. Widened to bf16 in registers, the fp8
    cache's decode attention took 0.80-0.83x the bf16 cache's time while reading half the bytes
    (H100, 2026-11-24, 3531f2d); widened to fp16, 0.58-0.77x (H100, 2026-11-27, 4f19535;
    docs/benchmarks-history.md). e4m3 -> fp16 is Hopper's own conversion (cvt.rn.f16x2.e4m3x2).
    fp16 holds what the dots see: q (|q| < 65504), e4m3's every value, and the softmax weights in
    [0, 1] with three more bits than bf16."""
    if k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16:
        return torch.float16
    return q.dtype


__all__ = ["HAS_TRITON", "LOG2E", "attend_kv_block", "cdiv", "dot", "fast_launch", "fp8_dot_dtype",
           "attention_shared_bytes", "fit_attention_launch", "grid_dependency_wait", "launch_dependents",
           "next_power_of_2", "num_sms", "pdl", "score_scale", "shared_memory_limit", "sink_weight",
           "triton",
           "tl", "zeroed_counters"]
