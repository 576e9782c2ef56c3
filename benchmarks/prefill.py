"""Full prefill of a 3072-token prompt: our runtime vs transformers, side by side.

Also the cold (GGUF conversion) and warm (model cache) start of the default model,
each in a fresh subprocess. Ends with one JSON line of headline figures.

    .venv/bin/python benchmarks/prefill.py [--tokens 3072] [--repeats 9] [--skip-cold]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvblend.generation import prefill
from kvblend.models import DEFAULT_MODEL, load_model

START_SNIPPET = (
    "import time, torch; t = time.perf_counter(); from kvblend.models import load_model; "
    "load_model({name!r}); print(time.perf_counter() - t)"
)


def interleaved(a, b, repeats: int) -> tuple[list[float], list[float]]:
    """Times of a and b, run alternately so machine noise hits both alike."""
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return ta, tb


def paired_ratio(ta: list[float], tb: list[float]) -> float:
    """Median over rounds of a/b within the same round. The shared host's speed drifts by
    tens of percent over minutes; a round's two runs see the same drift, so this is a
    second estimate beside the ratio of medians (and best against best)."""
    return statistics.median(x / y for x, y in zip(ta, tb))


def start_time(name: str, home: str | None) -> float:
    env = dict(os.environ, **({"KVBLEND_HOME": home} if home else {}))
    out = subprocess.run([sys.executable, "-c", START_SNIPPET.format(name=name)], env=env,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--skip-cold", action="store_true", help="skip the ~40 s GGUF conversion timing")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    loaded = load_model(DEFAULT_MODEL)
    ids = torch.randint(100, loaded.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=torch.float32, attn_implementation="sdpa").eval()

    def hf_prefill() -> None:
        with torch.inference_mode():
            hf(ids[None], logits_to_keep=1, use_cache=True)

    ours, theirs = interleaved(lambda: prefill(loaded.model, ids.tolist()), hf_prefill, args.repeats)
    ours_s, hf_s = statistics.median(ours), statistics.median(theirs)
    ratio, paired, best = ours_s / hf_s, paired_ratio(ours, theirs), min(ours) / min(theirs)
    print(f"ours          {ours_s:7.3f} s  (best {min(ours):.3f}; {args.tokens} tokens, median of "
          f"{args.repeats}, interleaved)", flush=True)
    print(f"transformers  {hf_s:7.3f} s  (best {min(theirs):.3f}; sdpa, logits_to_keep=1)", flush=True)
    print(f"ratio ours/transformers = {ratio:.3f} (of medians; {paired:.3f} median of per-round ratios, "
          f"{best:.3f} best against best)", flush=True)

    warm = statistics.median(start_time(DEFAULT_MODEL, None) for _ in range(3))
    print(f"warm start    {warm:7.3f} s  (model cache present; after `import torch`)", flush=True)
    cold = None
    if not args.skip_cold:
        with tempfile.TemporaryDirectory() as home:
            cold = start_time(DEFAULT_MODEL, home)
        print(f"cold start    {cold:7.3f} s  (empty model cache: GGUF conversion)", flush=True)
    print(json.dumps({"ours_s": round(ours_s, 3), "transformers_s": round(hf_s, 3),
                      "ratio": round(ratio, 3), "ratio_paired": round(paired, 3), "ratio_best": round(best, 3),
                      "tokens": args.tokens,
                      "cold_start_s": cold and round(cold, 2), "warm_start_s": round(warm, 2)}))


if __name__ == "__main__":
    main()
