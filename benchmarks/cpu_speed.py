"""Issue 42: kvblend's CPU speed against llama.cpp on the same model file, side by side.

One run loads the model twice from the same GGUF: kvblend through its own loader (fp32
weights for prefill, the packed decode weights ``--decode-weights`` for decode), and
llama.cpp through ``llama-cpp-python`` (the ``llamacpp`` extra; its own Q4/Q6/Q8 kernels).
Both use ``--threads`` threads and the same token ids, and each phase is timed on both
back to back, ``--repeats`` times interleaved, medians kept:

- prefill: ``--prompt-tokens`` tokens into an empty cache (tokens per second);
- decode, one stream: ``--decode-tokens`` greedy tokens after a ``--context``-token prompt
  (llama-bench's tg measures after an empty context; a RAG answer decodes after thousands);
- decode, ``--streams`` streams in one batch (kvblend only: llama-cpp-python runs one
  sequence), and the same with kvblend's fp32 decode weights, so the packed weights' gain
  is measured in this run too;
- the read bandwidth of this host (a sum over 512 MiB, median of 5), and from it the
  bound on decode: packed weight bytes read per token / bandwidth;
- ``kl_vs_fp32``: on ``--kl-questions`` MuSiQue dev questions (question + 2 passages), the
  fp32 path decodes 16 greedy tokens; the packed path decodes the same tokens (teacher
  forced) from the same prefill, and the mean next-token KL(fp32 ‖ packed) over positions
  and questions is reported;
- ``kv_bytes_per_token``: stored KV per token at the store's default dtype;
- ``decode_off_main_thread_tok_s``: one stream's decode run from a second Python thread, as
  the server's model worker runs it (the kernels' threads differ there), and its ratio to
  the main thread's, ``off_main_over_main``;
- with ``--profile``, ``torch.profiler``'s op table of five decode steps of one stream and
  of ``--streams`` streams, on stderr (where a step's time goes).

Prints one JSON line: every median, and the issue's ratios ``decode_over_llamacpp``,
``prefill_over_llamacpp`` (null without llama-cpp-python), ``decode_over_bandwidth_bound``,
``batch8_over_one``, ``kl_vs_fp32`` and ``kv_bytes_per_token``, with ``host_steal_share``.

    make llamacpp                            # builds llama.cpp (minutes), optional
    .venv/bin/python benchmarks/cpu_speed.py
    .venv/bin/python benchmarks/cpu_speed.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import HostSteal  # noqa: E402

from kvblend.eval.datasets import musique_query  # noqa: E402
from kvblend.generation import encode_prompt, render_chat  # noqa: E402
from kvblend.generation.batch import decode_batch  # noqa: E402
from kvblend.models import load_model  # noqa: E402
from kvblend.models.kv_cache import KVCache  # noqa: E402
from kvblend.models.loader import META_FILE  # noqa: E402
from kvblend.settings import StoreSettings  # noqa: E402
from kvblend.store.plan import kv_bytes_per_token  # noqa: E402

DATASET = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth_gbs(mib: int = 512) -> float:
    """Bytes per second a sum over ``mib`` MiB of fp32 reads (GB/s, median of 5)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    return x.numel() * 4 / median_s(lambda: x.sum(), 5) / 1e9


def gguf_of(loaded) -> Path | None:
    meta = loaded.folder / META_FILE
    source = json.loads(meta.read_text()).get("source") if meta.exists() else None
    return Path(source) if source and Path(source).is_file() else None


class Kvblend:
    """Prefill and decode timings of our model (its decode weights as loaded)."""

    def __init__(self, loaded) -> None:
        self.model = loaded.model

    def prefill_s(self, ids: list[int]) -> float:
        t = torch.tensor(ids)
        return median_s(lambda: self.model(t, self.model.new_cache(len(ids))), 1)

    def _cache(self, ids: list[int], room: int) -> KVCache:
        cache = self.model.new_cache(len(ids) + room)
        self.model(torch.tensor(ids), cache)
        return cache

    def decode_s_per_step(self, ids: list[int], steps: int, streams: int = 1) -> float:
        """Median seconds of one batched decode step of ``streams`` streams after ``ids``."""
        caches = [self._cache(ids, steps + 1) for _ in range(streams)]
        tokens, times = [ids[-1]] * streams, []
        for _ in range(steps):
            t = time.perf_counter()
            logits = decode_batch(self.model, tokens, caches)
            times.append(time.perf_counter() - t)
            tokens = logits.argmax(-1).tolist()
        return statistics.median(times[1:] if len(times) > 1 else times)

    def profile_table(self, ids: list[int], streams: int, steps: int = 5) -> str:
        """``torch.profiler``'s op table (self CPU time) of ``steps`` decode steps of
        ``streams`` streams after ``ids`` (two steps first, unprofiled)."""
        from torch.profiler import profile

        caches = [self._cache(ids, steps + 3) for _ in range(streams)]
        tokens = [ids[-1]] * streams
        for _ in range(2):
            tokens = decode_batch(self.model, tokens, caches).argmax(-1).tolist()
        with profile() as prof:
            for _ in range(steps):
                tokens = decode_batch(self.model, tokens, caches).argmax(-1).tolist()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


class LlamaCpp:
    """The same phases through llama-cpp-python's low-level eval (its own kernels)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, n_ubatch=512, verbose=False)

    def prefill_s(self, ids: list[int]) -> float:
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t

    def decode_s_per_step(self, ids: list[int], steps: int, follow: list[int]) -> float:
        """Median seconds of one decode step after ``ids``, feeding ``follow`` one token at a
        time (a step's work does not depend on which token it is)."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(ids)
        times = []
        for token in follow[:steps]:
            t = time.perf_counter()
            self.llm.eval([token])
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])


def kl_vs_fp32(loaded, kind: str, questions: int, new_tokens: int = 16) -> float | None:
    """Mean next-token KL(fp32 decode ‖ ``kind`` decode) over teacher-forced greedy tokens."""
    if kind == "fp32" or questions <= 0 or not DATASET.exists():
        return None
    model, tok = loaded.model, loaded.tokenizer
    examples = json.loads(DATASET.read_text())[:questions]
    kls = []
    for ex in examples:  # fp32 first: its greedy tokens are the ones both decode
        passages = "\n\n".join(c["text"] if isinstance(c, dict) else str(c) for c in ex["ctxs"][:2])
        text = f"{passages}\n\n{musique_query(ex['question'])}"
        # a base model (Gemma 3 270M) has no chat template: the plain prompt then
        ids = list(render_chat(tok, [{"role": "user", "content": text}]) if getattr(tok, "chat_template", None)
                   else encode_prompt(tok, text))
        runs = {}
        for weights in ("fp32", kind):
            model.pack_decode_weights(weights)
            cache = model.new_cache(len(ids) + new_tokens + 1)
            logits = [model(torch.tensor(ids), cache)[0]]
            forced = runs.get("fp32", (None, None))[1]
            tokens = []
            for i in range(new_tokens):
                nxt = int(logits[-1].argmax()) if forced is None else forced[i]
                tokens.append(nxt)
                logits.append(model(torch.tensor([nxt]), cache)[0])
            runs[weights] = (torch.stack(logits[1:]), tokens)
        ref, got = runs["fp32"][0], runs[kind][0]
        kls.append(F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
                   .sum(-1).mean().item())
    model.pack_decode_weights(kind)
    return statistics.fmean(kls)


def load(model: str, decode_weights: str):
    return load_model(model, decode_weights=decode_weights)


def token_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real text (the dev passages), the same for both engines."""
    text = " ".join(c["text"] if isinstance(c, dict) else str(c)
                    for ex in json.loads(DATASET.read_text())[:40] for c in ex["ctxs"])
    ids = tokenizer(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the dev passages hold {len(ids)} tokens, fewer than {n}")
    return list(ids[:n])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="packaged name or a .gguf (default: %(default)s)")
    p.add_argument("--decode-weights", default="auto", choices=("auto", "fp16", "int8"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kl-questions", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's op tables of decode steps to stderr")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steal = HostSteal()

    loaded = load(args.model, args.decode_weights)
    kind = loaded.model.decode_weights
    ours = Kvblend(loaded)
    prompt = token_ids(loaded.tokenizer, args.prompt_tokens)
    context = prompt[: args.context]
    if args.prompt_tokens < args.context + args.decode_tokens:
        raise SystemExit("--prompt-tokens must cover --context plus --decode-tokens")
    gguf = gguf_of(loaded)
    try:
        theirs = LlamaCpp(gguf, args.threads, args.prompt_tokens + 64) if gguf else None
        why = None if gguf else f"{args.model} was not loaded from a GGUF"
    except ImportError:
        theirs, why = None, "llama-cpp-python is not installed: make llamacpp"

    out: dict = {"model": args.model, "gguf": gguf.name if gguf else None, "decode_weights": kind,
                 "cpu": torch.backends.cpu.get_cpu_capability(), "threads": args.threads, "prompt_tokens": args.prompt_tokens, "context": args.context}
    samples: dict[str, list[float]] = {k: [] for k in ("prefill", "decode", "decode_fp32", "batch", "batch_fp32",
                                                      "llamacpp_prefill", "llamacpp_decode")}
    for _ in range(args.repeats):  # both engines, each phase, interleaved
        samples["prefill"].append(ours.prefill_s(prompt))
        if theirs:
            samples["llamacpp_prefill"].append(theirs.prefill_s(prompt))
        samples["decode"].append(ours.decode_s_per_step(context, args.decode_tokens))
        if theirs:
            samples["llamacpp_decode"].append(theirs.decode_s_per_step(context, args.decode_tokens,
                                                                         prompt[args.context:]))
        samples["batch"].append(ours.decode_s_per_step(context, args.decode_tokens // 2, args.streams))
        loaded.model.pack_decode_weights("fp32")
        samples["decode_fp32"].append(ours.decode_s_per_step(context, args.decode_tokens))
        samples["batch_fp32"].append(ours.decode_s_per_step(context, args.decode_tokens // 2, args.streams))
        loaded.model.pack_decode_weights(kind)
    med = {k: statistics.median(v) if v else None for k, v in samples.items()}
    off_main: list[float] = []
    worker = threading.Thread(target=lambda: off_main.append(ours.decode_s_per_step(context, args.decode_tokens)))
    worker.start()
    worker.join()

    def rate(tokens: int, seconds: float | None) -> float | None:
        return round(tokens / seconds, 1) if seconds else None

    out["prefill_tok_s"] = rate(args.prompt_tokens, med["prefill"])
    out["decode_tok_s"] = rate(1, med["decode"])
    out["decode_fp32_tok_s"] = rate(1, med["decode_fp32"])
    out["decode_off_main_thread_tok_s"] = rate(1, off_main[0] if off_main else None)
    out[f"batch{args.streams}_tok_s"] = rate(args.streams, med["batch"])
    out[f"batch{args.streams}_fp32_tok_s"] = rate(args.streams, med["batch_fp32"])
    out["llamacpp_prefill_tok_s"] = rate(args.prompt_tokens, med["llamacpp_prefill"])
    out["llamacpp_decode_tok_s"] = rate(1, med["llamacpp_decode"])
    out["llamacpp"] = why or "llama-cpp-python"
    bandwidth = read_bandwidth_gbs()
    weight_bytes = loaded.model.decode_weight_bytes()
    out["read_gb_s"] = round(bandwidth, 2)
    out["decode_weight_mb"] = round(weight_bytes / 1e6, 1)
    bound = bandwidth * 1e9 / weight_bytes
    out["decode_bound_tok_s"] = round(bound, 1)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    out["decode_over_llamacpp"] = ratio(out["decode_tok_s"], out["llamacpp_decode_tok_s"])
    out["prefill_over_llamacpp"] = ratio(out["prefill_tok_s"], out["llamacpp_prefill_tok_s"])
    out["decode_over_bandwidth_bound"] = ratio(out["decode_tok_s"], bound)
    out[f"batch{args.streams}_over_one"] = ratio(out[f"batch{args.streams}_tok_s"], out["decode_tok_s"])
    out["decode_over_fp32_decode"] = ratio(out["decode_tok_s"], out["decode_fp32_tok_s"])
    out["off_main_over_main"] = ratio(out["decode_off_main_thread_tok_s"], out["decode_tok_s"])
    out[f"batch{args.streams}_over_fp32"] = ratio(out[f"batch{args.streams}_tok_s"],
                                                  out[f"batch{args.streams}_fp32_tok_s"])
    out["kl_vs_fp32"] = kl_vs_fp32(loaded, kind, args.kl_questions)
    c = loaded.config
    kv_dtype = StoreSettings().kv_dtype
    out["kv_dtype"] = kv_dtype
    out["kv_bytes_per_token"] = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
    out["host_steal_share"] = steal.share()
    if args.profile:
        for streams in (1, args.streams):
            print(f"decode, {streams} stream(s), five steps:", ours.profile_table(context, streams), file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
