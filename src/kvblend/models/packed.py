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
import warnings
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

import torch

from kvblend.errors import KvblendError

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


class PackedWeight:
    """One linear layer's weight (out, in) and optional bias (out,), packed for decode.
    ``self(x)`` for x (R, in) fp32 is x W^T + b up to the packing's rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> None:
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
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
