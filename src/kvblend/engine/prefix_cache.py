"""Exact prefix reuse (the vLLM/SGLang baseline): the longest cached prefix of a token
sequence is reused losslessly, since a prefix's KV does not depend on what follows it.

The cache is a radix tree per scope, after SGLang's RadixAttention (Zheng et al., 2024):
each node holds a run of token ids (its edge) and the K/V of exactly those positions;
children are keyed by the first token of their edge (SGLang's page size 1, which keeps
matches exact to the token). A lookup walks one edge per level, so its cost grows with
the length of the match, not with the number of cached prompts. Eviction removes the
least recently used leaf until the byte and token caps hold again.

Every entry lives under a ``PrefixScope`` (tenant, model fingerprint, compute dtype):
a lookup only ever sees its own scope's tree, so one tenant can neither reuse nor learn
the length of another tenant's prefixes, and KV from another model or dtype is never served.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, NamedTuple

import torch

from kvblend.models.kv_cache import KVCache


class PrefixScope(NamedTuple):
    """What a cached prefix's KV depends on besides its tokens (and who may see it)."""

    tenant: str
    model: str  # the weights fingerprint
    dtype: str  # the compute dtype, e.g. "torch.float32"


class PrefixHit(NamedTuple):
    length: int
    keys: list[torch.Tensor]  # per layer (Hkv, length, d)
    values: list[torch.Tensor]
    entry: Any = None  # with ``lookup(whole_entries=True)``: what the entry that ends the hit was inserted with


_NO_ENTRY = object()  # a node no insert ended on


class _Node:
    """One edge of the tree: token ids and their K/V (per layer (Hkv, len, d))."""

    __slots__ = ("tokens", "keys", "values", "parent", "children", "last", "scope", "entry")

    def __init__(self, tokens: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor],
                 parent: _Node | None, scope: PrefixScope | None) -> None:
        self.tokens = tokens
        self.keys = keys
        self.values = values
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last = 0
        self.scope = scope
        self.entry: Any = _NO_ENTRY  # an ``insert(entry=...)`` ended at this edge's end

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def split(self, at: int) -> _Node:
        """Cut this edge after ``at`` tokens; return the new upper node (this one keeps the rest).

        Both halves are cloned so that each owns only its own memory. An entry ending at
        this edge's end stays with the lower half, which still ends there."""
        upper = _Node(self.tokens[:at], [k[:, :at].clone() for k in self.keys],
                      [v[:, :at].clone() for v in self.values], self.parent, self.scope)
        upper.last = self.last
        self.parent.children[self.tokens[0]] = upper
        upper.children[self.tokens[at]] = self
        self.tokens = self.tokens[at:]
        self.keys = [k[:, at:].clone() for k in self.keys]
        self.values = [v[:, at:].clone() for v in self.values]
        self.parent = upper
        return upper


def _common(edge: tuple[int, ...], ids: tuple[int, ...], start: int) -> int:
    """How many leading tokens of ``edge`` equal ``ids[start:]``."""
    n = min(len(edge), len(ids) - start)
    if edge[:n] == ids[start : start + n]:
        return n
    return next(i for i in range(n) if edge[i] != ids[start + i])


class PrefixCache:
    """Byte- and token-capped radix tree of prompt KVs, one tree per scope. Thread-safe.

    ``lookup`` never mutates cached tensors (callers copy what they read into their own
    cache); ``insert`` stores a copy of the positions not yet in the tree.
    """

    def __init__(self, max_bytes: int = 512 << 20, max_tokens: int | None = None) -> None:
        if max_bytes < 0 or (max_tokens is not None and max_tokens < 0):
            raise ValueError("prefix cache caps must be >= 0")
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self._roots: dict[PrefixScope, _Node] = {}
        self._bytes = 0
        self._tokens = 0
        self._nodes = 0
        self._leaves: list[tuple[int, int, _Node]] = []  # lazy min-heap of (last use, seq, leaf)
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._lock = threading.Lock()

    # ----- reading ---------------------------------------------------------------------
    def lookup(self, scope: PrefixScope, ids: torch.Tensor, max_len: int | None = None,
               whole_entries: bool = False) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` (at most ``max_len`` tokens) in ``scope``, or None.

        ``whole_entries``: only a prefix that some ``insert(entry=...)`` covered exactly, to
        its last token (the hit's ``entry`` is what that insert passed); for KV that is valid
        only as a whole sequence, not for every prefix of it."""
        want = tuple(ids.tolist())
        limit = len(want) if max_len is None else max(0, min(max_len, len(want)))
        with self._lock:
            parts, ends = self._match(scope, want[:limit])
        entry = None
        if whole_entries:
            if not ends:
                return None
            parts, entry = _cut(parts, ends[-1][0]), ends[-1][1]
        if not parts:
            return None
        layers = range(len(parts[0][0]))
        keys = [_join([(k[layer], n) for k, _, n in parts]) for layer in layers]
        values = [_join([(v[layer], n) for _, v, n in parts]) for layer in layers]
        return PrefixHit(sum(n for _, _, n in parts), keys, values, entry)

    def _match(self, scope: PrefixScope, want: tuple[int, ...]) -> tuple[list[tuple[list, list, int]], list]:
        """(keys, values, tokens used) of each node on the matched path, and the (length,
        entry) of each entry the match passes wholly; touches the path."""
        node, pos, parts, ends, now = self._roots.get(scope), 0, [], [], next(self._clock)
        while node is not None and pos < len(want):
            child = node.children.get(want[pos])
            if child is None:
                break
            n = _common(child.tokens, want, pos)
            parts.append((child.keys, child.values, n))
            pos += n
            child.last = now
            if not child.children:
                self._push_leaf(child)
            if n < len(child.tokens):
                break
            if child.entry is not _NO_ENTRY:
                ends.append((pos, child.entry))
            node = child
        return parts, ends

    # ----- writing ---------------------------------------------------------------------
    def insert(self, scope: PrefixScope, ids: torch.Tensor, cache: KVCache, length: int,
               entry: Any = _NO_ENTRY) -> None:
        """Remember the KV of ``ids[:length]`` taken from ``cache`` (positions 0..length-1).

        With ``entry``, the sequence is also marked whole, for ``lookup(whole_entries=True)``,
        which returns ``entry`` with it. Positions already in the tree keep the KV they have."""
        tokens = tuple(ids[:length].tolist())
        if not tokens:
            return
        with self._lock:
            parent, pos = self._walk_for_insert(scope, tokens, split_at_end=entry is not _NO_ENTRY)
            if pos == len(tokens):
                if entry is not _NO_ENTRY and parent.parent is not None:
                    parent.entry = entry
                return
            leaf = _Node(tokens[pos:], [cache.keys[i][:, pos:length].clone() for i in range(cache.num_layers)],
                         [cache.values[i][:, pos:length].clone() for i in range(cache.num_layers)], parent, scope)
            if not self._fits(leaf):
                if parent.parent is None and not parent.children:
                    del self._roots[scope]
                return
            leaf.last = next(self._clock)
            leaf.entry = entry
            parent.children[leaf.tokens[0]] = leaf
            self._account(leaf, +1)
            self._push_leaf(leaf)
            self._evict()

    def _walk_for_insert(self, scope: PrefixScope, tokens: tuple[int, ...],
                         split_at_end: bool = False) -> tuple[_Node, int]:
        """The node under which the rest of ``tokens`` belongs, and how many are already in.
        ``split_at_end``: where ``tokens`` end inside an edge, that edge is cut there, so
        that the node returned ends exactly where ``tokens`` do."""
        node = self._roots.get(scope)
        if node is None:
            node = self._roots[scope] = _Node((), [], [], None, scope)
        pos, now = 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens) and (pos + n < len(tokens) or split_at_end):
                child = child.split(n)  # the lower half keeps its own last use
                self._nodes += 1
            child.last = now
            if not child.children:
                self._push_leaf(child)
            pos += n
            node = child
            if n < len(child.tokens):
                break  # ``tokens`` ends inside this edge: all of it is cached already
        return node, pos

    def _fits(self, node: _Node) -> bool:
        return node.nbytes <= self.max_bytes and (self.max_tokens is None or len(node.tokens) <= self.max_tokens)

    def _account(self, node: _Node, sign: int) -> None:
        self._bytes += sign * node.nbytes
        self._tokens += sign * len(node.tokens)
        self._nodes += sign

    def _over(self) -> bool:
        return self._bytes > self.max_bytes or (self.max_tokens is not None and self._tokens > self.max_tokens)

    # ----- eviction --------------------------------------------------------------------
    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaves, (node.last, next(self._seq), node))
        if len(self._leaves) > 4 * self._nodes + 64:
            live = [(n.last, s, n) for _, s, n in self._leaves if self._is_live_leaf(n, n.last)]
            self._leaves = list({id(e[2]): e for e in live}.values())
            heapq.heapify(self._leaves)

    @staticmethod
    def _is_live_leaf(node: _Node, last: int) -> bool:
        return node.parent is not None and not node.children and node.last == last \
            and node.parent.children.get(node.tokens[0]) is node

    def _evict(self) -> None:
        """Drop least recently used leaves until the caps hold (a parent left childless
        becomes a leaf in turn)."""
        while self._over() and self._leaves:
            last, _, node = heapq.heappop(self._leaves)
            if not self._is_live_leaf(node, last):
                continue
            parent = node.parent
            del parent.children[node.tokens[0]]
            node.parent = None
            self._account(node, -1)
            if parent.parent is not None and not parent.children:
                self._push_leaf(parent)
            elif parent.parent is None and not parent.children:
                self._roots.pop(parent.scope, None)

    # ----- housekeeping ----------------------------------------------------------------
    def drop_scopes(self, which: Any) -> int:
        """Remove every scope for which ``which(scope)`` is true, with all its entries; how
        many tokens left the cache."""
        with self._lock:
            gone = [scope for scope in self._roots if which(scope)]
            tokens = 0
            for scope in gone:
                stack = list(self._roots.pop(scope).children.values())
                while stack:
                    node = stack.pop()
                    stack.extend(node.children.values())
                    tokens += len(node.tokens)
                    self._account(node, -1)
                    node.parent, node.children = None, {}  # any heap entry of it is dead now
            return tokens

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self._bytes, "tokens": self._tokens, "nodes": self._nodes, "scopes": len(self._roots)}

    def clear(self) -> None:
        with self._lock:
            self._roots.clear()
            self._leaves.clear()
            self._bytes = self._tokens = self._nodes = 0


def _cut(parts: list[tuple[list, list, int]], length: int) -> list[tuple[list, list, int]]:
    """The matched path's pieces up to its first ``length`` tokens."""
    out, pos = [], 0
    for keys, values, n in parts:
        if pos >= length:
            break
        out.append((keys, values, min(n, length - pos)))
        pos += n
    return out


def _join(pieces: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The first n positions of each (Hkv, len, d) piece, joined: (Hkv, total, d); a view
    when one node served the whole match."""
    views = [t[:, :n] for t, n in pieces]
    return views[0] if len(views) == 1 else torch.cat(views, dim=1)
