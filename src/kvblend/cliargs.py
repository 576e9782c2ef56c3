"""Model arguments and stats printing shared by the ``kvblend`` command and the modules that add subcommands
to it (``eval``), below both so neither imports the other. Imports stay lazy: building
the parser must not import torch."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
DECODE_WEIGHTS = ("auto", "fp32", "fp16", "int8")  # models.packed.DECODE_WEIGHTS (kept here: no torch import)
LOGPROBS_MODES = ("processed", "raw")  # generation.sampling.LOGPROBS_MODES (kept here: no torch import)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype`` and ``--decode-weights``."""
    from kvblend.settings import model_defaults

    s = model_defaults()  # one source of defaults: KVBLEND_* environment, KVBLEND_CONFIG file, built-ins
    p.add_argument("--model", default=s.model, help="packaged name, HF folder or .gguf (default: %(default)s)")
    p.add_argument("--device", default=s.device, help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default=s.dtype, choices=DTYPES, help="compute dtype (default: %(default)s)")
    p.add_argument("--decode-weights", default=s.decode_weights, choices=DECODE_WEIGHTS,
                   help="packed weights decode steps read: auto = int8 on the CPU (fp32 compute), none on CUDA; "
                        "fp32 = the exact reference (default: %(default)s)")


def load_from_args(args: argparse.Namespace) -> Any:
    """The ``LoadedModel`` the model arguments name."""
    import torch

    from kvblend.models import load_model

    return load_model(args.model, args.device, getattr(torch, args.dtype), decode_weights=args.decode_weights)


def print_stats(s: Any) -> None:
    """A request's ``RequestStats`` as two lines on stderr."""
    hits = sum(d.hit for d in s.docs)
    print(f"\n[{s.method}] {s.prompt_tokens} prompt tokens, prefix hit {s.prefix_hit_tokens}, "
          f"documents {hits}/{len(s.docs)} from cache, recomputed {s.recompute_frac:.1%} of token-layers",
          file=sys.stderr)
    print(f"[time] lookup {s.lookup_s:.3f}s  load {s.load_s:.3f}s  prefill/recompute {s.prefill_s:.3f}s  "
          f"first token {s.ttft_s:.3f}s", file=sys.stderr)
