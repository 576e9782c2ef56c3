"""The ``kvblend`` command line: models, generate, ask, demo, store, eval."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvblend.cliargs import add_model_args as _add_model_args
from kvblend.cliargs import DECODE_WEIGHTS, DTYPES, LOGPROBS_MODES
from kvblend.cliargs import load_from_args as _load
from kvblend.cliargs import print_stats as _print_stats
from kvblend.errors import KvblendError


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


def _read_text(value: str | None) -> str:
    if value is not None and value != "-":
        return value
    if sys.stdin.isatty():
        raise KvblendError("no prompt given: pass it as an argument or on stdin")
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text stream (tests)
        return sys.stdin.read()
    data = raw.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvblendError(f"the text on stdin is not UTF-8 (byte {exc.start})") from None


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

    text = _read_text(args.prompt)  # before the model: a bad prompt fails at once
    loaded = _load(args)
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
    """The flags' ``BlendConfig`` over the ``blend.*`` settings (the flags' defaults), by the
    rule a request's ``kvblend`` options and the settings follow
    (``settings.deviation_selection``): a knob of deviation selection (``--check-layers``,
    ``--schedule``, ``--signal``) without ``--selection`` selects by deviation; with another
    selection it would change nothing and is refused. With no such flag, the settings'
    own knobs and selection stand unless ``--selection`` names another."""
    from dataclasses import replace

    from kvblend.blend.config import BlendConfig

    if args.method == "cacheblend":  # the paper's selection, whatever the strategy flags say
        return BlendConfig.cacheblend(args.ratio, args.chunk_prefix)
    from kvblend.errors import InvalidRequestError
    from kvblend.settings import DEVIATION_KNOBS, deviation_selection

    base = args.blend_settings  # the settings the flags' defaults came from, read once
    given = [name for name in DEVIATION_KNOBS if getattr(args, name) is not None]
    try:
        selection = deviation_selection(given, args.selection) or base.selection
    except InvalidRequestError as exc:
        raise KvblendError(f"--{(exc.field or '').replace('_', '-')} applies to --selection deviation only, "
                           f"not {args.selection}") from None
    try:
        layers = tuple(int(x) for x in args.check_layers.split(",")) if args.check_layers else base.check_layers
        schedule = tuple(float(x) for x in args.schedule.split(",")) if args.schedule else base.schedule
    except ValueError as exc:
        raise KvblendError(f"--check-layers and --schedule take comma-separated numbers: {exc}") from None
    if args.check_layers and not args.schedule:
        schedule = None  # a schedule is one ratio per check layer: the settings' would not fit new layers
    return replace(base, ratio=args.ratio, check_layers=layers, schedule=schedule, signal=args.signal or base.signal,
                   chunk_prefix=args.chunk_prefix, selection=selection, budget=args.budget,
                   sinks=args.sinks, shift=args.shift, vdev=args.vdev)


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _default_ratio() -> float | str:
    """The blend's ratio as the settings give it (``blend.ratio``; the built-in default
    ``BlendConfig.ratio``): the demo's default, like the blend flags'."""
    from kvblend.settings import blend_defaults

    return blend_defaults().ratio


def _ratio(text: str) -> float | str:
    return text if text == "auto" else float(text)


def _add_blend_args(p: argparse.ArgumentParser) -> None:
    """The blend flags, each defaulting to its ``blend.*`` setting (``settings.blend_defaults``)."""
    from kvblend.blend.config import CHUNK_PREFIXES, METHODS, SIGNALS, BlendConfig
    from kvblend.settings import blend_defaults

    b = blend_defaults()
    method = b.method if b.method in METHODS else "blend"  # "auto" needs the server's quality guard
    p.add_argument("--method", default=method, choices=(*METHODS, "cacheblend"),
                   help=f"default: {method} (blend.method); cacheblend: blend with the paper's selection "
                        "(V deviation at layer 1)")
    p.add_argument("--ratio", type=_ratio, default=b.ratio,
                   help=f"recompute ratio in [0, 1], or 'auto' (the loading controller picks it); default {b.ratio}")
    p.add_argument("--check-layers", default=None,
                   help="comma-separated check layers of deviation selection (default: blend.check_layers, "
                        f"{','.join(map(str, b.check_layers))})")
    p.add_argument("--schedule", default=None, help="deviation selection's ratio per check layer, non-increasing")
    p.add_argument("--signal", default=None, choices=SIGNALS,
                   help=f"deviation selection's signal (default: blend.signal, {b.signal})")
    p.add_argument("--chunk-prefix", default=b.chunk_prefix, choices=CHUNK_PREFIXES)
    p.add_argument("--selection", default=None, choices=("deviation", "question"),
                   help=f"how recomputed tokens are chosen (default: blend.selection, {b.selection}; deviation "
                        "when a deviation knob is given; see kvblend.blend.strategies)")
    p.add_argument("--budget", action=argparse.BooleanOptionalAction, default=b.budget,
                   help="per-document budgets by attention mass")
    p.add_argument("--sinks", type=int, default=b.sinks, help="first K tokens of each document always")
    p.add_argument("--shift", action=argparse.BooleanOptionalAction, default=b.shift,
                   help="correct tokens not recomputed by their document's mean residual")
    p.add_argument("--vdev", type=float, default=BlendConfig.vdev,
                   help="with --selection question: weight in [0, 1] of the layer-1 V deviation's "
                        "within-document rank in a hybrid score (0.5: equal; 0: off)")
    # blend.calibrate: whether the engine tests the shift; the settings' BlendConfig, which
    # the flags are applied over (``_blend_config``)
    p.set_defaults(calibrate=b.calibrate, blend_settings=b.blend_config())


def cmd_ask(args: argparse.Namespace) -> int:
    from kvblend.commands.ingest import _store
    from kvblend.engine import Engine
    from kvblend.engine.shaping import Draft, shape

    if not args.doc:
        from kvblend.commands.ingest import run_retrieval_ask

        kw = dict(system=args.system, method=args.method, blend=_blend_config(args))
        return run_retrieval_ask(args, _read_text(args.question), kw, _sampling(args))
    docs = []
    for path in args.doc:
        try:
            docs.append(Path(path).read_text())
        except OSError as exc:
            raise KvblendError(f"cannot read document {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise KvblendError(f"cannot read document {path}: not UTF-8 text (byte {exc.start})") from exc
    _refuse_retrieval_flags(args)
    draft = Draft(documents=docs, question=_read_text(args.question), system=args.system, tenant=args.tenant,
                  method="blend" if args.method == "cacheblend" else args.method, blend=_blend_config(args))
    loaded = _load(args)
    engine = Engine(loaded, store=_store(args, loaded), calibrate=args.calibrate)
    try:
        result = engine.generate(shape(engine, draft, cut=_document_cut(engine)).request, _sampling(args))
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.text.strip())
        _print_stats(result.stats)
    return 0


def _refuse_retrieval_flags(args: argparse.Namespace) -> None:
    """``--doc`` names the documents: a retrieval flag given with it would be ignored."""
    given = [flag for flag, value in (("--chunks", args.chunks), ("--compare", args.compare or None),
                                      ("--index", args.index), ("--retriever", args.retriever)) if value is not None]
    if given:
        raise KvblendError(f"{', '.join(given)} retrieve documents: not with --doc, which names them")


def _document_cut(engine):
    """A ``--doc`` file cut as ``POST /v1/documents`` cuts it (``server.translate.document_chunks``
    at the server's ``documents.chunk_tokens``, from the same settings), so that each
    chunk's KV is the one the server and ingest store."""
    import functools

    from kvblend.server.translate import document_chunks
    from kvblend.settings import Settings

    return functools.partial(document_chunks, engine, chunk_tokens=Settings.load().documents.chunk_tokens)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvblend.demo import run_demo

    return run_demo(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvblend.settings import Settings

    flags = {"host": args.host, "port": args.port, "model": args.model, "device": args.device, "dtype": args.dtype,
             "decode_weights": args.decode_weights, "logprobs_mode": args.logprobs_mode,
             "served_model_name": args.served_model_name, "log_level": args.log_level}
    cluster = {k: v for k, v in (("replicas", args.replicas), ("ray_address", args.ray_address),
                                 ("router", args.router)) if v is not None}
    settings = Settings.load(args.config, **flags, cluster=cluster or None)
    if args.print_config:
        print(json.dumps(settings.redacted(), indent=2))
        return 0
    if settings.cluster.replicas is not None:  # Ray Serve (the `cluster` extra); imported only here
        from kvblend.cluster.app import serve_cluster

        return serve_cluster(settings)
    from kvblend.server.main import serve

    return serve(settings)


def _add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible RAG server (documents field, tenants, metrics)")
    p.add_argument("--config", default=None, help="YAML settings file (flags > KVBLEND_* env > file > defaults)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--model", default=None, help="packaged name, HF folder or .gguf (default smollm2-135m)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="compute dtype (default float32)")
    p.add_argument("--decode-weights", default=None, choices=DECODE_WEIGHTS,
                   help="packed weights decode steps read (default auto: int8 on the CPU; fp32 = the reference)")
    p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"))
    p.add_argument("--logprobs-mode", default=None, choices=LOGPROBS_MODES,
                   help="logprobs of the logits the draw used, after mask, bias and penalties (default), "
                        "or of the model's raw ones")
    p.add_argument("--replicas", type=int, default=None,
                   help="run as a Ray Serve application with N model replicas (needs kvblend[cluster])")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join with --replicas (default: start one)")
    p.add_argument("--router", default=None, choices=("affinity", "default"),
                   help="how --replicas routes: documents held in memory (default) or Ray's default")
    p.add_argument("--print-config", action="store_true", help="print the merged settings (keys hidden) and exit")
    p.set_defaults(func=cmd_serve)


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

    from kvblend.commands.ingest import add_ask_args, add_ingest_command, top_k_arg

    add_ingest_command(sub)
    p = sub.add_parser("ask", help="answer a question over documents (--doc) or retrieved chunks, with KV reuse")
    p.add_argument("question", nargs="?", default=None)
    p.add_argument("--doc", action="append", default=[], help="a document file (repeatable, in order)")
    p.add_argument("--system", default=None)
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--store-dir", default=None,
                   help="chunk KV disk tier (default: store.disk_dir, else $KVBLEND_HOME/kv: the server's)")
    p.add_argument("--redis-url", default=None)
    _add_model_args(p)
    _add_sampling_args(p)
    _add_blend_args(p)
    add_ask_args(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("demo", help="ingest a small MuSiQue corpus, answer by retrieval + blend, TTFT vs full prefill")
    _add_model_args(p)
    p.add_argument("--ratio", type=_ratio, default=_default_ratio(), help="the blend's ratio (default %(default)s)")
    p.add_argument("--questions", type=_count, default=2, help="questions to answer (of 3)")
    p.add_argument("--chunks", type=top_k_arg, default=4, help="passages retrieved per question (top-k)")
    p.set_defaults(func=cmd_demo)

    _add_serve_command(sub)
    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    from kvblend.eval.harness import add_eval_commands
    from kvblend.commands.profile import add_profile_command
    from kvblend.commands.store import cmd_store
    from kvblend.store.cli import add_store_commands

    add_store_commands(sub, run=cmd_store)
    add_eval_commands(sub)
    add_profile_command(sub)


def _parser(argv: Sequence[str] | None) -> argparse.ArgumentParser:
    """The parser, its defaults from the settings (invalid ones: SettingsError). Help is
    still shown while the settings are broken: the error first, then the built-in defaults."""
    from kvblend.settings import SettingsError, builtin_defaults

    try:
        return build_parser()
    except SettingsError as exc:
        words = list(sys.argv[1:] if argv is None else argv)
        if words and not {"-h", "--help"} & set(words):
            raise
        print(f"kvblend: warning: {exc}; the defaults shown are the built-in ones", file=sys.stderr)
        with builtin_defaults():
            return build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser(argv).parse_args(argv)  # invalid KVBLEND_* defaults are a clear error (help aside)
        return args.func(args)
    except KvblendError as exc:
        print(f"kvblend: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvblend: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that is missing, a file where a folder should be, ...
        where = f": {exc.filename}" if exc.filename else ""
        print(f"kvblend: error: {exc.strerror or str(exc) or type(exc).__name__}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the command line shows one line, not a traceback
        if os.environ.get("KVBLEND_DEBUG"):
            raise
        print(f"kvblend: error: {type(exc).__name__}: {exc} (set KVBLEND_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1
