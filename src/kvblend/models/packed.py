"""Decode weights: each linear layer's weight packed a second time for decode steps.

A decode step multiplies one row per stream by every weight matrix, so on a CPU it is
bound by the bytes of weight it reads, not by arithmetic. Prefill multiplies hundreds of
rows and is bound by arithmetic, where fp32 GEMM is fastest here. So the model keeps its
fp32 weights for prefill (the reference path, and what every stored KV is computed with)
and, beside them, a packed copy that only decode passes read:

* ``int8`` — int8 weights with one scale per output row (a quarter of fp32's bytes). The
  kernels are kvblend's own (``csrc/packed_int8.cpp``), compiled once per machine for its
  CPU with torch's extension builder (~20 s, ``native_int8``). With AVX-512 VNNI each
  activation row goes in as two 8-bit rows, itself and its rounding remainder (~16 bits,
  ``native_activation_error``), through VNNI's int8 dot products; with AVX2 but no VNNI as
  one 16-bit row (``vpmaddwd`` against the weights widened to 16 bits: widening them to
  float32 left SmolLM2's decode compute-bound on a Zen 3); elsewhere activations stay
  float32 and the weights are widened to float32. Either way the error is the weights' rounding (SmolLM2's next-token KL to fp32 ~0.002) and a row's
  result never depends on the rows beside it (a stream's tokens do not change with load).
  Measured first and slower at a decode step's shapes: FBGEMM's dynamically quantized
  linear (7-bit activations over one range per call, which alone cost SmolLM2 a KL of
  0.047) and torch's own weight-pack matmuls (docs/results.md 9). The same
  library runs a decoder layer's decode step, its K/V write and attention included, as
  native calls (``native_layer_ops``). Where it cannot be built, ``auto`` decodes fp32 and an explicit
  ``int8`` multiplies by the dequantized weight as tensor ops (correct, not fast).
* ``fp16`` — FBGEMM's fp16 GEMM (``quantized::linear_dynamic_fp16``): weights stored in
  fp16, converted and multiplied in fp32. Half the bytes, error ~2e-4 relative per matmul.
* ``fp32`` — no packed copy: decode reads the fp32 weights (the exact reference).

Which passes are decode passes is one rule, ``decode_pass``: every step of the pass
appends exactly one token. Such a pass runs inside ``decoding()``; ``Linear`` reads
``is_decoding()`` and multiplies by its packed copy there. Passes that append a prompt's
tokens (prefill, a blend's recompute) never do, so stored KV is the same whatever the
decode weights are. A step of one token riding beside a prefill slice is split into a
decode pass of its own (``generation.batch.forward_batch``), so that its result never
depends on what shares its scheduler step.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import platform
import threading
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvblend.errors import KvblendError

log = logging.getLogger(__name__)

DECODE_WEIGHTS = ("auto", "fp32", "fp16", "int8")

_DECODING: ContextVar[bool] = ContextVar("kvblend_decoding", default=False)


@contextlib.contextmanager
def decoding(active: bool = True) -> Iterator[None]:
    """Within it (when ``active``), linear layers with a packed copy multiply by it."""
    token = _DECODING.set(active)
    try:
        yield
    finally:
        _DECODING.reset(token)


def is_decoding() -> bool:
    return _DECODING.get()


def decode_pass(sizes: Iterable[int]) -> bool:
    """Whether a pass whose steps append these numbers of tokens is a decode pass (each
    step one token): the one rule for which passes read the packed decode weights."""
    sizes = list(sizes)
    return bool(sizes) and all(s == 1 for s in sizes)


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_decode_weights(kind: str, device: str | torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``int8`` for fp32 on a CPU where the int8 kernels are built with a vector
    path (``native_int8``), else ``fp32`` (no packed copy: on CUDA decode reads the
    compute-dtype weights). An explicit packed kind off the CPU or with another compute
    dtype is an error (the kernels are CPU and fp32 only); ``fp16`` also needs FBGEMM."""
    if kind not in DECODE_WEIGHTS:
        raise KvblendError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}, got {kind!r}")
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if kind == "auto":
        return "int8" if cpu_fp32 and native_int8() is not None and native_lanes() > 0 else "fp32"
    if kind != "fp32" and not (cpu_fp32 and (kind == "int8" or fbgemm_available())):
        raise KvblendError(f"decode_weights {kind!r} needs the CPU and float32 compute"
                           f"{' and FBGEMM' if kind == 'fp16' else ''} (got device {device}, dtype {dtype}); "
                           "use 'fp32' or 'auto'")
    return kind


NATIVE_SOURCE = Path(__file__).parent / "csrc" / "packed_int8.cpp"
_NATIVE: Callable[..., torch.Tensor] | bool | None = None  # the op, False (unavailable) or None (not tried)
_NATIVE_LOCK = threading.Lock()


def native_int8() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.kvblend_packed.int8_linear`` (``csrc/packed_int8.cpp``: x, int8 weight,
    per-row scales, bias -> x W^T + b), compiled on first use for this CPU (``-march=native``)
    and kept in torch's extension folder (``TORCH_EXTENSIONS_DIR``), keyed by the source,
    torch's version and the CPU's features; None where it cannot be built (no C++
    compiler). Tried once per process."""
    global _NATIVE
    if _NATIVE is not None:  # settled: no lock on a decode step's path
        return _NATIVE or None
    with _NATIVE_LOCK:
        if _NATIVE is None:
            try:
                _NATIVE = _load_native()
            except Exception as exc:  # noqa: BLE001 - any build failure leaves the tensor-op path
                log.warning("the int8 decode kernel could not be built (%s); decoding with tensor ops", exc)
                _NATIVE = False
        return _NATIVE or None


def native_lanes() -> int:
    """Float32 lanes of the built kernels' vector path (16 AVX-512, 8 AVX2; 0 none or not built)."""
    return int(torch.ops.kvblend_packed.simd_lanes()) if native_int8() is not None else 0


class NativeLayerOps(NamedTuple):
    """A decoder layer's decode step in native calls (``csrc/packed_int8.cpp``)."""

    project: Callable[..., torch.Tensor]  # DecoderLayer.project: norm, q|k|v, q/k norms, RoPE
    attend_rows: Callable[..., torch.Tensor]  # each row's K/V write and attention (inside ``layer``)
    finish: Callable[..., torch.Tensor]  # DecoderLayer.finish: o, residual, norm, MLP, residual
    layer: Callable[..., torch.Tensor]  # DecoderLayer.decode_rows: the rows' project, attend_rows, finish
    layers: Callable[..., torch.Tensor]  # Transformer.decode_layers: every layer's ``layer`` in one call


_LAYER_OPS: NativeLayerOps | None = None


def native_activation_error() -> float:
    """The int8 kernels' largest activation error relative to a row's max |x| (their VNNI
    and AVX2 paths round activations to ~16 bits; 0: float32 activations, or not built)."""
    return float(torch.ops.kvblend_packed.activation_error()) if native_int8() is not None else 0.0


def native_layer_ops() -> NativeLayerOps | None:
    """The decode-step ops of ``native_int8``'s library, or None where it could not be built
    (looked up once: this is on every decode layer's path)."""
    global _LAYER_OPS
    if _LAYER_OPS is None and native_int8() is not None:
        ops = torch.ops.kvblend_packed
        _LAYER_OPS = NativeLayerOps(ops.decode_project, ops.decode_attend_rows, ops.decode_finish, ops.decode_layer,
                                     ops.decode_layers)
    return _LAYER_OPS


def _cpu_features() -> bytes:
    """What ``-march=native`` compiles for: the CPU's flags (Linux), else its name."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    return platform.processor().encode() + platform.machine().encode()


def _load_native() -> Callable[..., torch.Tensor]:
    from torch.utils import cpp_extension

    # KVBLEND_NATIVE_ARCH: the -march to build for (default "native"; "haswell" builds the AVX2
    # path on an AVX-512 machine, as tests of that path do)
    arch = os.environ.get("KVBLEND_NATIVE_ARCH", "native")
    key = NATIVE_SOURCE.read_bytes() + torch.__version__.encode() + _cpu_features() + arch.encode()
    name = f"kvblend_packed_{hashlib.sha256(key).hexdigest()[:12]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    folder = root / name
    library = folder / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        folder.mkdir(parents=True, exist_ok=True)
        log.info("building kvblend's int8 decode kernels once for this machine (~20 s) in %s", folder)
        with _ninja_on_path():
            cpp_extension.load(name=name, sources=[str(NATIVE_SOURCE)],
                               extra_cflags=["-O3", f"-march={arch}", "-fopenmp"], extra_ldflags=["-fopenmp"],
                               build_directory=str(folder), is_python_module=False, verbose=False)
    return torch.ops.kvblend_packed.int8_linear


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` package's binary
    is not on it when Python runs from a venv that was not activated."""
    try:
        import ninja
    except ImportError:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def tiles_kind() -> str:
    """The second layout of the int8 weights the built kernels read, beside row-major ``q``:
    ``"amx"`` (AMX tiles, where built with AMX and granted the tiles), ``"int16"`` (four rows'
    16 inputs a cache line, for the AVX2 path without VNNI) or ``""`` (none)."""
    return str(torch.ops.kvblend_packed.tiles_kind()) if native_int8() is not None else ""


def pack_tiles(q: torch.Tensor) -> torch.Tensor | None:
    """``q`` (out, in) int8 in the layout of ``tiles_kind`` (None: none here, or a width the
    layout does not take)."""
    kind = tiles_kind()
    if kind == "amx":
        return torch.ops.kvblend_packed.amx_pack(q)
    if kind == "int16" and q.shape[1] % 16 == 0:
        return torch.ops.kvblend_packed.int16_pack(q)
    return None


class PackedWeight:
    """One linear layer's weight (out, in) and optional bias (out,), packed for decode.
    ``self(x)`` for x (R, in) fp32 is x W^T + b up to the packing's rounding. ``int8``: the
    weight rounded per output row to 127 levels of its max |w| (``q``, ``scale``; ``rowsum``
    for the VNNI path), multiplied by ``native_int8``'s kernel when it is built and
    ``native`` (the default), else as tensor ops over the dequantized weight; the two agree
    within the kernel's activation rounding (``native_activation_error``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, native: bool = True) -> None:
        if kind not in ("int8", "fp16"):
            raise ValueError(f"no packed form {kind!r}")
        self.kind = kind
        self.in_features = weight.shape[1]
        self.arena: mmap.mmap | None = None  # the mapping ``q`` lives in (``in_huge_pages``)
        w = weight.detach().float()
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        self.fused = False
        if kind == "fp16":
            self._packed = torch.ops.quantized.linear_prepack_fp16(w.contiguous(), self.bias)
            return
        scale = w.abs().amax(dim=1).clamp_min(1e-12).div_(127.0)  # per output row, symmetric
        self.q = torch.round(w / scale[:, None]).to(torch.int8).contiguous()
        self.scale = scale.contiguous()
        self.rowsum = self.q.sum(dim=1, dtype=torch.int32)  # what the kernels' VNNI path corrects by
        self._native = native_int8() if native else None
        # a copy of q in the layout the kernels read fastest here (``pack_tiles``): AMX tiles
        # (faster than VNNI at any row count), or on AVX2 four rows a cache line (weights
        # streamed from memory as one run); q stays, for the other paths and the references
        self.tiles = pack_tiles(self.q) if self._native is not None else None
        # a decoder layer whose weights all run natively runs its decode step as two native
        # calls (``native_layer_ops``); False keeps it per op (A/B measurements)
        self.fused = self._native is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        if self._native is not None:
            return self._native(x, self.q, self.scale, self.rowsum, self.bias, self.tiles)
        return self.int8_linear_ops(x)

    def int8_linear_ops(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 matmul as tensor ops (where the kernel is not built): the dequantized
        weight's matmul."""
        return F.linear(x, self.q.float().mul_(self.scale[:, None]), self.bias)


HUGE_PAGE = 2 << 20


def in_huge_pages(weights: list[PackedWeight]) -> mmap.mmap | None:
    """Move the int8 weights' bytes into one anonymous mapping advised for transparent huge
    pages (Linux, THP ``madvise`` or ``always``), each weight's ``q`` a view of it. A decode
    step streams every weight once: in 4 KiB pages that is a TLB miss every 4 KiB, and on
    SmolLM2 (135 MB) one stream decoded 12.3 -> 11.6 ms a step with huge pages (in-process,
    2 threads, AnonHugePages confirmed). Where the advice is refused the mapping still
    works, in small pages. Each weight keeps the mapping alive; returns it (None: nothing
    to move, or no ``madvise`` on this platform)."""
    int8 = [w for w in weights if w.kind == "int8"]
    if not int8 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    moving = [(w, name) for w in int8 for name in ("q", "tiles") if getattr(w, name) is not None]
    sizes = [(getattr(w, name).numel() + 63) // 64 * 64 for w, name in moving]
    # private: THP covers private anonymous memory (a shared mapping is shmem, another setting)
    mapping = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        log.debug("transparent huge pages refused; decode weights in small pages")
    arena = torch.frombuffer(mapping, dtype=torch.int8)
    at = -arena.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary
    for (weight, name), size in zip(moving, sizes):
        streamed = getattr(weight, name)
        moved = arena[at : at + streamed.numel()].view(streamed.shape)
        moved.copy_(streamed)
        setattr(weight, name, moved)
        weight.arena = mapping
        at += size
    return mapping


def packed_bytes(weight: torch.Tensor, kind: str) -> int:
    """Bytes a decode step reads for this weight in this packed form (scales included)."""
    per = {"int8": 1, "fp16": 2, "fp32": 4}[kind]
    extra = weight.shape[0] * 4 if kind == "int8" else 0
    return weight.numel() * per + extra
