"""Structured outputs: a grammar masks the logits at each decode step (xgrammar).

A request's ``ResponseFormat`` (OpenAI's ``response_format``: ``json_object``, or
``json_schema`` with its ``strict``) is compiled once per tokenizer and format
(``Grammars``: an LRU of compiled grammars, shared by the server's check and the decode
slots); each choice gets its own ``Constraint`` (an xgrammar matcher) that says which
tokens may come next and follows the tokens drawn. The mask only touches decode, so it
serves whatever built the prompt's KV (every method).

JSON is compact (``any_whitespace`` off: xgrammar's separators, no free whitespace), so a
small model cannot wander in whitespace until max_tokens, a known failure of free-
whitespace grammars. xgrammar 0.2.8 lets a string with ``maxLength`` hold raw control
characters (its bounded-string rule lacks the escapes; plain strings are right).

xgrammar was chosen over llguidance by ``benchmarks/grammar_engines.py`` (docs/results.md
§10): both cost microseconds a token against decode steps of tens of milliseconds, and of
20 schema constructs xgrammar compiles ``oneOf`` (llguidance only approximates it) and
compiles but ignores eight keywords llguidance refuses; those eight are refused here
(``refuse_unenforced``), so neither engine's gaps reach an answer. A schema it cannot
compile is a ``GrammarError`` naming the construct (a 400 at the server), never a failure
in the worker.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvblend.errors import InvalidRequestError

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per tokenizer


class ResponseFormat(NamedTuple):
    """What the answer must be: ``kind`` "json_object" (any JSON object) or "json_schema"
    (``schema``: the schema as compact JSON text, so equal schemas share a grammar;
    ``strict``: properties not listed are refused, OpenAI's strict mode)."""

    kind: str
    schema: str = ""
    strict: bool = False
    prefix: str = ""  # literal text before the JSON (a tool call's opening tag)
    suffix: str = ""  # and after it

    @classmethod
    def json_schema(cls, schema: dict[str, Any], strict: bool, prefix: str = "", suffix: str = "") -> ResponseFormat:
        # key order kept: it orders the answer
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), bool(strict), prefix, suffix)


class GrammarError(InvalidRequestError):
    """A response format the grammar engine cannot compile (its message names the construct)."""


class Constraint:
    """One choice's grammar state: ``allowed`` tokens next (``GrammarError`` when none
    is), ``accept`` the one drawn; ``terminated`` once a stop token ended the grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V/32)) int32

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar accepts next."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = np.unpackbits(self.bitmask[0].numpy().view(np.uint8), count=self.vocab_size, bitorder="little")
        if not bits.any():  # token i: bit i; a vocabulary that cannot spell what the grammar needs next
            raise GrammarError("no token of the model's vocabulary continues the response format here",
                               "response_format")
        return torch.from_numpy(bits.view(np.bool_))  # (V,) 0/1 bytes seen as bool, no copy; torch's shifts took ~25 ms

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class Grammars:
    """Compiled grammars of one tokenizer (``vocab_size``: the logits' width; ``stop_ids``:
    the tokens that end an answer), cached per ``ResponseFormat``. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # ours is the cache
        self.cache: OrderedDict[ResponseFormat, Any] = OrderedDict()
        self.lock = threading.Lock()

    def compiled(self, fmt: ResponseFormat) -> Any:
        """The compiled grammar of ``fmt`` (cached); ``GrammarError`` when it does not compile."""
        with self.lock:
            if fmt in self.cache:
                self.cache.move_to_end(fmt)
                return self.cache[fmt]
        grammar = self._compile(fmt)
        with self.lock:
            self.cache[fmt] = grammar
            while len(self.cache) > GRAMMAR_CACHE_SIZE:
                self.cache.popitem(last=False)
        return grammar

    def _compile(self, fmt: ResponseFormat) -> Any:
        if fmt.kind == "json_schema":
            refuse_unenforced(json.loads(fmt.schema))
        try:
            if fmt.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                         any_whitespace=False)
            if not (fmt.prefix or fmt.suffix):
                return self.compiler.compile_json_schema(fmt.schema, strict_mode=fmt.strict, any_whitespace=False)
            return self.compiler.compile_grammar(_framed(fmt))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the construct
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"the schema cannot be compiled: {reason.split('] ', 1)[-1]}",
                               "response_format.json_schema.schema") from None

    def constraint(self, fmt: ResponseFormat) -> Constraint:
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(self.compiled(fmt)), self.vocab_size)


# JSON Schema keywords xgrammar 0.2.8 compiles but does not enforce: an instance breaking
# them is accepted (benchmarks/grammar_engines.py walks each with a violating instance).
# A schema using one is refused, never followed halfway.
UNENFORCED_KEYWORDS = ("uniqueItems", "not", "contains", "multipleOf", "dependentRequired", "dependentSchemas",
                       "if", "then", "else", "unevaluatedProperties")
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def refuse_unenforced(schema: Any) -> None:
    """``GrammarError`` naming the first keyword of ``UNENFORCED_KEYWORDS`` in ``schema``
    and where it is (a JSON pointer). Walks subschemas only: a property named ``not`` is a
    name, not the keyword, and ``enum``/``const`` values are data. Iterative, so a client's
    deep nesting costs a list, not the worker's stack."""
    todo: list[tuple[Any, str]] = [(schema, "#")]
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node:
                raise GrammarError(f"the schema uses {keyword!r} (at {path}), which the grammar engine (xgrammar) "
                                   "does not enforce: remove it, or check it after the answer",
                                   "response_format.json_schema.schema")
        for key in _NAMED_SUBSCHEMAS:
            if isinstance(node.get(key), dict):
                todo.extend((sub, f"{path}/{key}/{name}") for name, sub in node[key].items())
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                todo.append((node[key], f"{path}/{key}"))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                todo.extend((sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key]))


def _framed(fmt: ResponseFormat) -> Any:
    """``fmt``'s JSON Schema between its literal prefix and suffix, as one grammar."""
    import xgrammar as xgr

    parts = [xgr.Grammar.from_json_schema(fmt.schema, strict_mode=fmt.strict, any_whitespace=False)]
    if fmt.prefix:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(fmt.prefix)}"))
    if fmt.suffix:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(fmt.suffix)}"))
    return xgr.Grammar.concat(*parts)


_registry: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Grammars]] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def grammars(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> Grammars:
    """The process's ``Grammars`` for ``tokenizer`` (made once, kept while it lives)."""
    key = (vocab_size, tuple(sorted(stop_ids)))
    with _registry_lock:
        per = _registry.setdefault(tokenizer, {})
        if key not in per:
            per[key] = Grammars(tokenizer, vocab_size, stop_ids)
        return per[key]
