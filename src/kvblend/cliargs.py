"""Model arguments shared by the ``kvblend`` command and the modules that add subcommands
to it (``eval``), below both so neither imports the other. Imports stay lazy: building
the parser must not import torch."""

from __future__ import annotations

import argparse
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device`` and ``--dtype``."""
    from kvblend.settings import model_defaults

    s = model_defaults()  # one source of defaults: KVBLEND_* environment, KVBLEND_CONFIG file, built-ins
    p.add_argument("--model", default=s.model, help="packaged name, HF folder or .gguf (default: %(default)s)")
    p.add_argument("--device", default=s.device, help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default=s.dtype, choices=DTYPES, help="compute dtype (default: %(default)s)")


def load_from_args(args: argparse.Namespace) -> Any:
    """The ``LoadedModel`` the model arguments name."""
    import torch

    from kvblend.models import load_model

    return load_model(args.model, args.device, getattr(torch, args.dtype))
