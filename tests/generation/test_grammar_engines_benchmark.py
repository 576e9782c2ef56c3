"""benchmarks/grammar_engines.py: xgrammar walks the benchmark's instance token by token,
every construct it compiles but does not enforce is one kvblend refuses, and a missing
llguidance is reported, not fatal (no timing asserted here)."""

from __future__ import annotations

import json

import pytest
from tests.benchmarks import load_benchmark

from kvblend.generation import grammar

ge = load_benchmark("grammar_engines")


def test_one_json_line_without_llguidance(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    def missing(self, *args):
        raise ImportError("No module named 'llguidance'")

    monkeypatch.setattr(ge.LLGuidance, "__init__", missing)
    assert ge.main(["--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    x = out["xgrammar"]
    assert x["mask_us_median"] > 0 and x["compiled"] == sum(s["ok"] for s in x["schemas"].values())
    assert not x["schemas"]["unknown type (should fail)"]["ok"]
    assert out["llguidance"] == {"missing": "No module named 'llguidance'"}


@pytest.mark.parametrize("keyword", grammar.UNENFORCED_KEYWORDS)
def test_each_unenforced_keyword_is_refused(keyword: str) -> None:
    with pytest.raises(grammar.GrammarError, match=repr(keyword)):
        grammar.refuse_unenforced({"type": "object", keyword: {}})
