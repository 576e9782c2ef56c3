"""benchmarks/cpu_speed.py without llama.cpp (never needed by the tests): it times our
model, prints one JSON line whose ratios are its own medians' ratios, and says why the
llama.cpp columns are empty (no timing asserted here)."""

from __future__ import annotations

import json

import pytest
from tests.benchmarks import load_benchmark

from kvblend.models.packed import fbgemm_available
from tests.conftest import make_loaded

cs = load_benchmark("cpu_speed")
pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM (the packed decode weights) is in every x86 build of torch")


def test_one_json_line_with_the_issues_ratios(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    tiny = make_loaded()

    def load(model: str, decode_weights: str):
        tiny.model.pack_decode_weights("int8")
        return tiny

    monkeypatch.setattr(cs, "load", load)
    monkeypatch.setattr(cs, "token_ids", lambda tokenizer, n: [3 + i % 40 for i in range(n)])
    monkeypatch.setattr(cs, "read_bandwidth_gbs", lambda mib=512: 10.0)
    assert cs.main(["--prompt-tokens", "64", "--context", "16", "--decode-tokens", "6", "--streams", "3",
                    "--repeats", "1", "--kl-questions", "0", "--profile"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    # --profile: the op tables of one stream's and three streams' decode steps, on stderr
    assert "decode, 1 stream(s)" in captured.err and "decode, 3 stream(s)" in captured.err
    assert "kvblend_packed::decode_layer" in captured.err
    out = json.loads(line)
    assert out["decode_weights"] == "int8" and out["llamacpp"].endswith("not loaded from a GGUF")
    assert out["off_main_over_main"] == pytest.approx(out["decode_off_main_thread_tok_s"] / out["decode_tok_s"], rel=1e-2)
    assert out["decode_over_llamacpp"] is None and out["llamacpp_decode_tok_s"] is None
    assert out["batch3_over_one"] == pytest.approx(out["batch3_tok_s"] / out["decode_tok_s"], rel=1e-2)
    assert out["decode_bound_tok_s"] == pytest.approx(10e9 / tiny.model.decode_weight_bytes(), rel=1e-2)
    assert out["decode_over_bandwidth_bound"] == pytest.approx(out["decode_tok_s"] / out["decode_bound_tok_s"],
                                                               rel=1e-2, abs=1e-3)
    cfg = tiny.config
    assert out["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # fp16 default
    assert tiny.model.decode_weights == "int8"  # the fp32 comparison put the packed weights back


def test_kl_is_of_the_packed_decode_against_fp32(monkeypatch) -> None:
    """The KL the benchmark reports is of the packed decode against the fp32 one on the same
    forced tokens: with fp16 weights on a tiny model it is small and positive, and it
    restores the packed weights it measured."""
    tiny = make_loaded()
    monkeypatch.setattr(cs, "render_chat", lambda tokenizer, messages: [3 + i % 40 for i in range(12)])
    tiny.model.pack_decode_weights("fp16")
    kl = cs.kl_vs_fp32(tiny, "fp16", questions=2, new_tokens=4)
    assert kl is not None and 0 <= kl < 1e-3
    assert tiny.model.decode_weights == "fp16"
    assert cs.kl_vs_fp32(tiny, "fp32", questions=2) is None
