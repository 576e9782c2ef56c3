"""Decode weights: each linear layer's weight packed a second time for decode steps.

A decode step multiplies one row per stream by every weight matrix, so on a CPU it is
bound by the bytes of weight it reads, not by arithmetic. Prefill multiplies hundreds of
rows and is bound by arithmetic, where fp32 GEMM is fastest here. So the model keeps its
fp32 weights for prefill (the reference path, and what every stored KV is computed with)
and, beside them, a packed copy that only decode passes read:

* ``int8`` — FBGEMM's dynamically quantized linear (``quantized::linear_dynamic``):
  weights int8 with one scale per output row (a quarter of fp32's bytes), activations
  quantized at each call. FBGEMM takes one activation range for the whole input: each row
  is scaled to max |x| = 1 and a pinning row (+1, -1) is added, so every row is quantized
  over its own range and a row's result does not depend on the other rows of its batch (a
  stream's tokens do not change with load). FBGEMM's activations have 7 bits, which alone
  cost SmolLM2 a next-token KL of 0.047 to fp32: each row goes in twice, as itself and as
  what its rounding lost (at most half a step, so times 127 it fits [-1, 1] again), so activations carry ~14 bits and the
  KL is the int8 weights' alone (0.0017, as weight-only int8 with fp32 activations). The
  extra rows ride on the same pass over the weights, which is what decode pays for.
  That arithmetic around the kernel is a dozen small tensor ops, which from Python cost as
  much as the matmul at a decode step's shapes: ``csrc/packed_int8.cpp`` does it in one
  call (``native_int8``: compiled once per machine with torch's extension builder, ~15 s;
  where no compiler is found the same arithmetic runs as tensor ops, ``int8_linear_ops``).
* ``fp16`` — FBGEMM's fp16 GEMM (``quantized::linear_dynamic_fp16``): weights stored in
  fp16, converted and multiplied in fp32. Half the bytes, error ~2e-4 relative per matmul.
* ``fp32`` — no packed copy: decode reads the fp32 weights (the exact reference).

Which passes are decode passes is one rule, ``decode_pass``: every step of the pass
appends exactly one token. Such a pass runs inside ``decoding()``; ``Linear`` reads
``is_decoding()`` and multiplies by its packed copy there. Passes that append a prompt's
tokens (prefill, a blend's recompute, a prefill slice riding beside decodes) never do, so
stored KV is the same whatever the decode weights are.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path

import torch

from kvblend.errors import KvblendError

log = logging.getLogger(__name__)

DECODE_WEIGHTS = ("auto", "fp32", "fp16", "int8")

# FBGEMM's activation grid over the pinned range [-1, 1]: 7 bits (reduce_range, which keeps
# AVX2's 16-bit pair sums from saturating), a step of 2/127, so x rounds to round(x * 63.5) / 63.5.
STEPS = 63.5

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
    """``auto`` -> ``int8`` for fp32 on a CPU with FBGEMM, else ``fp32`` (no packed copy:
    on CUDA decode reads the compute-dtype weights). An explicit packed kind off the CPU,
    or with another compute dtype, is an error (FBGEMM kernels are CPU and fp32 only)."""
    if kind not in DECODE_WEIGHTS:
        raise KvblendError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}, got {kind!r}")
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32 and fbgemm_available()
    if kind == "auto":
        return "int8" if cpu_fp32 else "fp32"
    if kind != "fp32" and not cpu_fp32:
        raise KvblendError(f"decode_weights {kind!r} needs the CPU, float32 compute and FBGEMM "
                         f"(got device {device}, dtype {dtype}); use 'fp32' or 'auto'")
    return kind


NATIVE_SOURCE = Path(__file__).parent / "csrc" / "packed_int8.cpp"
_NATIVE: Callable[..., torch.Tensor] | bool | None = None  # the op, False (unavailable) or None (not tried)
_NATIVE_LOCK = threading.Lock()


def native_int8() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.kvblend_packed.int8_linear`` (``csrc/packed_int8.cpp``: x, packed FBGEMM
    params, bias -> the int8 decode linear in one call), compiled on first use and kept in
    torch's extension folder (``TORCH_EXTENSIONS_DIR``), keyed by the source and torch's
    version; None where it cannot be built (no C++ compiler): callers then run the same
    arithmetic as tensor ops. Tried once per process."""
    global _NATIVE
    with _NATIVE_LOCK:
        if _NATIVE is None:
            try:
                _NATIVE = _load_native()
            except Exception as exc:  # noqa: BLE001 - any build failure leaves the tensor-op path
                log.warning("the int8 decode kernel could not be built (%s); decoding with tensor ops", exc)
                _NATIVE = False
        return _NATIVE or None


def _load_native() -> Callable[..., torch.Tensor]:
    from torch.utils import cpp_extension

    digest = hashlib.sha256(NATIVE_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    name = f"kvblend_packed_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    folder = root / name
    library = folder / f"{name}.so"
    if library.exists():
        torch.ops.load_library(str(library))
    else:
        folder.mkdir(parents=True, exist_ok=True)
        log.info("building kvblend's int8 decode kernel once for this machine (~15 s) in %s", folder)
        with _ninja_on_path():
            cpp_extension.load(name=name, sources=[str(NATIVE_SOURCE)], extra_cflags=["-O3"],
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


class PackedWeight:
    """One linear layer's weight (out, in) and optional bias (out,), packed for decode.
    ``self(x)`` for x (R, in) fp32 is x W^T + b up to the packing's rounding. ``native``
    (int8): run through ``native_int8``'s one-call kernel when it is available (the
    default), else as tensor ops; the two agree to float32 rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, native: bool = True) -> None:
        if kind not in ("int8", "fp16"):
            raise ValueError(f"no packed form {kind!r}")
        self.kind = kind
        self.in_features = weight.shape[1]
        w = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().clone()
        if kind == "fp16":
            self._packed = torch.ops.quantized.linear_prepack_fp16(w, self.bias)
            return
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # per output row, symmetric
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated for creation, not for FBGEMM's packing
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        pin = torch.zeros(self.in_features)
        pin[0], pin[-1] = 1.0, -1.0
        self._pin = pin  # fixes the input's range at [-1, 1] whatever the other rows hold
        self._native = native_int8() if native else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        if self._native is not None:
            return self._native(x, self._packed, self.bias)
        return self.int8_linear_ops(x)

    def int8_linear_ops(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 path as tensor ops (where the one-call kernel is not built)."""
        rows = x.shape[0]
        norm = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)  # max |x| a row
        rows_in = x.new_empty(2 * rows + 1, self.in_features)
        hi = torch.div(x, norm, out=rows_in[:rows])  # each row in [-1, 1]
        lo = torch.mul(hi, STEPS, out=rows_in[rows : 2 * rows])
        lo.sub_(lo.round()).mul_(2)  # what the grid rounds away (at most half a step, 1/127), times 127
        rows_in[-1] = self._pin
        out = torch.ops.quantized.linear_dynamic(rows_in, self._packed, True)
        y = torch.add(out[:rows], out[rows : 2 * rows], alpha=1 / 127).mul_(norm)
        return y if self.bias is None else y.add_(self.bias)


def packed_bytes(weight: torch.Tensor, kind: str) -> int:
    """Bytes a decode step reads for this weight in this packed form (scales included)."""
    per = {"int8": 1, "fp16": 2, "fp32": 4}[kind]
    extra = weight.shape[0] * 4 if kind == "int8" else 0
    return weight.numel() * per + extra
