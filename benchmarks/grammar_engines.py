"""Issue 43 point 1: the grammar engine chosen by measurement. xgrammar (kvblend's) against
llguidance on this CPU and the model's tokenizer: schema coverage, compile time, and the
mask's cost per decode token.

    .venv/bin/pip install llguidance==1.9.1      # optional; without it only xgrammar is measured
    .venv/bin/python benchmarks/grammar_engines.py [--model smollm2-135m]

For each engine:
- ``tokenizer_s``: building its view of the tokenizer (once per process);
- per schema of ``SCHEMAS`` (the tests' schemas, the constrained benchmark's, and JSON Schema
  constructs apps send): whether it compiles (``ok``, else the first line of its error),
  and the cold compile time;
- per token, walking the tokens of a valid compact instance of ``ARRAY`` (30 names): the
  mask filled into a 32-bit bitmask, unpacked to one bool a token as kvblend's decode slot
  does (numpy), and the token accepted: median and p95 microseconds, over ``--rounds`` walks.

Both compile JSON without free whitespace (xgrammar's fixed separators ", " and ": ", as
kvblend does). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import HostSteal  # noqa: E402

from kvblend.models.loader import load_model  # noqa: E402

ARRAY = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string"}, "minItems": 30}},
         "required": ["names"], "additionalProperties": False}
NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}
SCHEMAS = {
    "tests: enum + boolean + integer range": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "sure": {"type": "boolean"},
                                         "floor": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "sure", "floor"], "additionalProperties": False},
    "benchmark: array of 30 strings": ARRAY,
    "recursive $ref": {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf of objects": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                   {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "pattern with lookbehind": {"type": "string", "pattern": "(?<=a)b"},
    "format date-time": {"type": "string", "format": "date-time"},
    "string minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 8},
    "number exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "const": {"const": "x"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "array minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "minProperties": {"type": "object", "minProperties": 1},
    "unresolvable $ref (should fail)": {"$ref": "#/$defs/missing"},
    "unknown type (should fail)": {"type": "strin"},
}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[-1][:160]


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - t

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True, any_whitespace=False)

    def walker(self, compiled):
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)

        def step(token: int) -> None:
            matcher.fill_next_token_bitmask(bitmask)
            allowed = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
            if not allowed[token] or not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")

        return step


class LLGuidance:
    name = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # xgrammar's

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.vocab_size = vocab_size
        t = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids)
        self.tokenizer_s = time.perf_counter() - t

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.OPTIONS)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def walker(self, grammar):
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        bitmask = np.full((1, (self.vocab_size + 31) // 32), -1, dtype=np.int32)

        def step(token: int) -> None:
            row = bitmask[0]
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)
            allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab_size]
            if not allowed[token] or not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")

        return step


def measure(engine, tokens: list[int], rounds: int) -> dict:
    out: dict = {"tokenizer_s": round(engine.tokenizer_s, 3), "schemas": {}}
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        try:
            engine.compile(schema)
            out["schemas"][name] = {"ok": True, "compile_ms": round((time.perf_counter() - t) * 1e3, 2)}
        except Exception as exc:  # noqa: BLE001 - each engine raises its own kinds
            out["schemas"][name] = {"ok": False, "error": first_line(exc)}
    compiled = engine.compile(ARRAY)
    per_token: list[float] = []
    for _ in range(rounds):
        step = engine.walker(compiled)
        for token in tokens:
            t = time.perf_counter()
            step(token)
            per_token.append(time.perf_counter() - t)
    per_token.sort()
    out["mask_us_median"] = round(statistics.median(per_token) * 1e6, 1)
    out["mask_us_p95"] = round(per_token[int(0.95 * (len(per_token) - 1))] * 1e6, 1)
    out["compiled"] = sum(s["ok"] for s in out["schemas"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    steal = HostSteal()
    loaded = load_model(args.model, weights=False)
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    stop_ids = list(loaded.eos_token_ids)
    instance = json.dumps({"names": [f"Scientist {i}" for i in range(30)]})  # xgrammar's separators: ", " and ": "
    tokens = tok(instance, add_special_tokens=False)["input_ids"]
    result: dict = {"model": args.model, "vocab": vocab, "instance_tokens": len(tokens)}
    for cls in (XGrammar, LLGuidance):
        try:
            engine = cls(tok, vocab, stop_ids)
        except ImportError as exc:
            result[cls.name] = {"missing": first_line(exc)}
            continue
        result[cls.name] = measure(engine, tokens, args.rounds)
    result["host_steal_share"] = steal.share()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
