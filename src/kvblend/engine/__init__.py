"""Request path: layout -> prefix cache -> chunk lookup -> fusion -> decode."""

from kvblend.engine.engine import Engine, Prepared
from kvblend.engine.prefix_cache import PrefixCache, PrefixScope
from kvblend.engine.request import CheckStat, DocStat, Request, RequestStats, Result

__all__ = ["CheckStat", "DocStat", "Engine", "Prepared", "PrefixCache", "PrefixScope", "Request", "RequestStats",
           "Result"]
