"""Which documents a replica holds: the summary replicas report to the request router.

(Interim version, written against the contract agreed with the router's author; their
``affinity.py`` replaces it.) ``ResidentSummary`` is a set of chunk key strings
(``tenant/digest``: the tenant is part of every key, so a summary never matches another
tenant's document).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResidentSummary:
    """The chunk keys held in a replica's memory tier."""

    keys: frozenset[str] = frozenset()

    @classmethod
    def from_keys(cls, keys: Iterable[str]) -> ResidentSummary:
        return cls(frozenset(keys))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "keys", "keys": sorted(self.keys)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ResidentSummary:
        return cls(frozenset((data or {}).get("keys", ())))

    def __contains__(self, key: object) -> bool:
        return key in self.keys


__all__ = ["ResidentSummary"]
