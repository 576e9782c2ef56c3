"""benchmarks/quant_matmul.py: its quantizers hold the kernels' conventions, so the speedups
it prints are for matmuls that compute what they should (no timing asserted here)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from tests.benchmarks import load_benchmark

from kvblend.models.packed import fbgemm_available

qm = load_benchmark("quant_matmul")
pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM (the packed decode weights) is in every x86 build of torch")


@pytest.mark.parametrize("out,inp,batch", [(192, 576, 1), (576, 1536, 8)])
def test_packed_matmuls_equal_the_dequantized_fp32_matmul(out: int, inp: int, batch: int) -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(out, inp, generator=g) * 0.05, torch.randn(batch, inp, generator=g)
    q8, s8 = qm.quantize_int8(w)
    torch.testing.assert_close(torch._weight_int8pack_mm(x, q8, s8), F.linear(x, q8.float() * s8[:, None]),
                               rtol=1e-5, atol=1e-5)
    q4, sz = qm.quantize_int4(w)
    packed = torch._convert_weight_to_int4pack_for_cpu(q4, qm.INNER_K_TILES)
    dq = qm.dequantize_int4(q4, sz)
    torch.testing.assert_close(torch._weight_int4pack_mm_for_cpu(x, packed, qm.GROUP, sz), F.linear(x, dq),
                               rtol=1e-5, atol=1e-5)
    # the quantizers themselves: within half a step of the weights
    assert (q8.float() * s8[:, None] - w).abs().max() <= s8.max() * 0.51
    assert (dq - w).abs().max() <= sz[..., 0].max() * 0.51


def test_the_probe_prints_one_json_line(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(qm, "SHAPES", {"k_proj": (192, 576, 30), "lm_head": (512, 576, 1)})
    assert qm.main(["--threads", "1", "--repeats", "3", "--batches", "1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = json.loads(line)
    step = result["batch1"]["decode_step"]
    rows = result["batch1"]["shapes"]
    assert step["fp32_us"] == pytest.approx(rows["k_proj"]["fp32_us"] * 30 + rows["lm_head"]["fp32_us"])
    assert step["int4_speedup"] == pytest.approx(step["fp32_us"] / step["int4_us"])
    assert all(r["int8_err"] < 1e-5 and r["int4_err"] < 1e-5 for r in rows.values())
    assert step["fbgemm8_speedup"] == pytest.approx(step["fp32_us"] / step["fbgemm8_us"])
    assert step["kvblend8_speedup"] == pytest.approx(step["fp32_us"] / step["kvblend8_us"])
    assert all(r["fbgemm8_err_vs_fp32"] < 0.05 and r["fbgemm16_err_vs_fp32"] < 1e-3 for r in rows.values())
    # weight-only: the weights' rounding alone, well under FBGEMM's 7-bit activations'
    assert all(r["kvblend8_err_vs_fp32"] < 0.01 for r in rows.values())
