"""Probe for issue 42 point 1: torch's own packed-weight matmuls against fp32 ``F.linear``
on SmolLM2-135M's decode shapes, CPU.

For each projection of a SmolLM2 layer (q/o 576->576, k/v 576->192, gate/up 576->1536,
down 1536->576) and the LM head (576->49152), at batch 1 and 8, it times:

- ``fp32``: ``torch.nn.functional.linear`` on the fp32 weight (what decode runs today);
- ``int8``: ``torch._weight_int8pack_mm`` on int8 weights with one fp32 scale per output row;
- ``int4``: ``torch._weight_int4pack_mm_for_cpu`` on weights packed by
  ``torch._convert_weight_to_int4pack_for_cpu``, asymmetric int4 in groups of 32 along the
  input (the layout of GGUF's Q4_0/Q4_1/Q4_K blocks);
- ``fbgemm8``: FBGEMM's dynamically quantized int8 linear as torch.ao calls it
  (``quantized::linear_dynamic``: 7-bit activations over one range per call);
- ``kvblend8`` and ``fbgemm16``: kvblend's decode weights (``kvblend.models.packed``): its
  own weight-only int8 kernel (``csrc/packed_int8.cpp``) and FBGEMM's fp16-weight GEMM.

Each time is the median of ``--repeats`` calls after a warm-up, the three variants
interleaved call by call so that a busy machine slows them alike. Each call reads the next
of as many copies of its weight as a decode step uses (30 per layer projection), so that
weights come from memory as in a real decode step, not from the cache the previous call
filled (``--hot``: one copy, cache-resident). Before timing, each packed
matmul is checked against the fp32 matmul of its own dequantized weight (``*_err``: the
largest difference relative to the output's largest magnitude; float rounding only, so it
should stay near 1e-6 for fp32 activations).

Prints one JSON line: per shape and batch the medians in microseconds and the speedups
``fp32_us / <form>_us`` for each packed form (above 1: the packed matmul is faster), and
``decode_step``: the same sums over one decode step's matmuls (30 layers + the LM head).

    .venv/bin/python benchmarks/quant_matmul.py --threads 2 --repeats 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvblend.models.packed import PackedWeight

HIDDEN, INTERMEDIATE, VOCAB, KV_OUT, LAYERS = 576, 1536, 49152, 192, 30
SHAPES = {  # name: (out, in, uses per decode step)
    "q_proj": (HIDDEN, HIDDEN, LAYERS), "k_proj": (KV_OUT, HIDDEN, LAYERS), "v_proj": (KV_OUT, HIDDEN, LAYERS),
    "o_proj": (HIDDEN, HIDDEN, LAYERS), "gate_proj": (INTERMEDIATE, HIDDEN, LAYERS),
    "up_proj": (INTERMEDIATE, HIDDEN, LAYERS), "down_proj": (HIDDEN, INTERMEDIATE, LAYERS),
    "lm_head": (VOCAB, HIDDEN, 1),
}
GROUP = 32
FORMS = ("fp32", "int8", "int4", "fbgemm8", "fbgemm16", "kvblend8")
INNER_K_TILES = 2


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q (N, K) int8, scale (N,) fp32); w ≈ q * scale[:, None]."""
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group`` input columns, in the tinygemm convention the
    int4pack kernels use: w ≈ (q - 8) * scale + zero, q in 0..15. Returns (q (N, K) int32,
    scales_and_zeros (K / group, N, 2) fp32)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)  # (N, G)
    zero = lo + scale * 8
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    n, k = q.shape
    scale, zero = sz[..., 0].t(), sz[..., 1].t()  # (N, G)
    return ((q.reshape(n, k // group, group).float() - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


def medians_us(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median microseconds of each function over ``repeats`` rounds, run interleaved
    (a, b, c, a, b, c, ...) so that all see the same machine load; warm-up rounds first."""
    times: list[list[int]] = [[] for _ in fns]
    for round_ in range(repeats + max(5, repeats // 10)):
        for fn, samples in zip(fns, times):
            t = time.perf_counter_ns()
            fn()
            if round_ >= max(5, repeats // 10):
                samples.append(time.perf_counter_ns() - t)
    return [statistics.median(samples) / 1e3 for samples in times]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


class Weights:
    """``copies`` distinct weights of one shape in each form, handed out in turn, so that a
    timed call reads its weight from memory as a decode step does (30 layers' weights do not
    stay in cache) rather than from the cache the previous call filled."""

    def __init__(self, out: int, inp: int, copies: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.fp32 = [torch.randn(out, inp, generator=g) * 0.05 for _ in range(copies)]
        self.int8 = [quantize_int8(w) for w in self.fp32]
        self.int4 = [quantize_int4(w) for w in self.fp32]
        self.packed = [(torch._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES), sz) for q, sz in self.int4]
        with warnings.catch_warnings():  # quantized tensors are deprecated for creation, not for FBGEMM's packing
            warnings.simplefilter("ignore")
            self.fbgemm8 = [torch.ops.quantized.linear_prepack(torch.quantize_per_channel(
                w, (w.abs().amax(dim=1) / 127).double(), torch.zeros(out, dtype=torch.long), 0, torch.qint8), None)
                for w in self.fp32]
        self.kvblend8 = [PackedWeight(w, None, "int8") for w in self.fp32]
        self.fbgemm16 = [PackedWeight(w, None, "fp16") for w in self.fp32]
        self.turn = [0] * len(FORMS)

    def next(self, form: int) -> int:
        i = self.turn[form]
        self.turn[form] = (i + 1) % len(self.fp32)
        return i


def probe(out: int, inp: int, batch: int, repeats: int, copies: int = 1) -> dict[str, float]:
    ws = Weights(out, inp, copies, out * 7 + inp)
    x = torch.randn(batch, inp, generator=torch.Generator().manual_seed(inp))
    (q8, s8), (q4, sz) = ws.int8[0], ws.int4[0]

    def fp32() -> torch.Tensor:
        return F.linear(x, ws.fp32[ws.next(0)])

    def int8() -> torch.Tensor:
        return torch._weight_int8pack_mm(x, *ws.int8[ws.next(1)])

    def int4() -> torch.Tensor:
        packed, scales_zeros = ws.packed[ws.next(2)]
        return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)

    def fbgemm8() -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, ws.fbgemm8[ws.next(3)], True)

    def fbgemm16() -> torch.Tensor:
        return ws.fbgemm16[ws.next(4)](x)

    def kvblend8() -> torch.Tensor:
        return ws.kvblend8[ws.next(5)](x)

    times = medians_us([fp32, int8, int4, fbgemm8, fbgemm16, kvblend8], repeats)
    packed = ws.packed[0][0]
    row = {
        "int8_err": rel_err(torch._weight_int8pack_mm(x, q8, s8), F.linear(x, q8.float() * s8[:, None])),
        "int4_err": rel_err(torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
                            F.linear(x, dequantize_int4(q4, sz))),
        # against the exact fp32 matmul: FBGEMM's int8 also rounds the activations (7 bits)
        "fbgemm8_err_vs_fp32": rel_err(torch.ops.quantized.linear_dynamic(x, ws.fbgemm8[0], True),
                                       F.linear(x, ws.fp32[0])),
        "kvblend8_err_vs_fp32": rel_err(ws.kvblend8[0](x), F.linear(x, ws.fp32[0])),
        "fbgemm16_err_vs_fp32": rel_err(ws.fbgemm16[0](x), F.linear(x, ws.fp32[0])),
    }
    row.update({f"{form}_us": t for form, t in zip(FORMS, times)})
    for form in FORMS[1:]:
        row[f"{form}_speedup"] = row["fp32_us"] / row[f"{form}_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--hot", action="store_true",
                   help="one weight per shape, cache-resident between calls (default: as many copies as a "
                        "decode step uses, read in turn)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result: dict[str, object] = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
                                 "weights": "hot" if args.hot else "cold"}
    for batch in (int(b) for b in args.batches.split(",")):
        rows = {name: probe(o, i, batch, args.repeats, 1 if args.hot else uses)
                for name, (o, i, uses) in SHAPES.items()}
        step = {f"{f}_us": sum(rows[n][f"{f}_us"] * SHAPES[n][2] for n in rows) for f in FORMS}
        for form in FORMS[1:]:
            step[f"{form}_speedup"] = step["fp32_us"] / step[f"{form}_us"]
        result[f"batch{batch}"] = {"shapes": rows, "decode_step": step}
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
