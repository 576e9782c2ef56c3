"""A disk store an fp32 server filled, opened by a server at today's default (fp16 storage):
the storage dtype is part of every chunk key, so the fp32 entries are a clean miss (each
document recomputed and stored again in fp16, the answer the fp16 server gives on an empty
store, nothing counted corrupt, nothing of the old store deleted), and a server set back to
``store.kv_dtype: fp32`` still loads them."""

from __future__ import annotations

from pathlib import Path

import torch

from kvblend.engine import Engine, Request
from kvblend.store import StoreConfig, build_store
from tests.conftest import make_loaded
from tests.engine.test_blend_invariants import DOCS, QUESTION

REQUEST = dict(documents=DOCS, question=QUESTION, system="answer the question .", method="blend")


def disk_engine(folder: Path, kv_dtype: str | None = None) -> Engine:
    """An engine over a disk-only store in ``folder`` (None: the default storage dtype)."""
    dtype = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
    return Engine(make_loaded(), store=build_store(StoreConfig(tiers=("disk",), disk_dir=str(folder),
                                                               disk_fsync=False, **dtype)))


def answer(eng: Engine) -> tuple[torch.Tensor, list[str]]:
    prepared = eng.prepare(Request(**REQUEST))
    eng.flush()
    return prepared.logits, [d.source for d in prepared.stats.docs]


def test_an_fp32_store_is_a_clean_miss_for_the_fp16_default_and_loads_when_set_back(tmp_path: Path) -> None:
    old = disk_engine(tmp_path / "kv", "fp32")
    fp32_logits, sources = answer(old)
    assert sources == ["chunk"] * 3 and answer(old)[1] == ["disk"] * 3  # stored, then served from disk
    old_files = sorted(p.name for p in (tmp_path / "kv").rglob("*") if p.is_file())
    old.close()

    new = disk_engine(tmp_path / "kv")  # today's default
    assert new.kv_dtype == "fp16"
    logits, sources = answer(new)
    assert sources == ["chunk"] * 3  # missed: recomputed, not read as something else
    fresh = disk_engine(tmp_path / "empty")
    torch.testing.assert_close(logits, answer(fresh)[0], rtol=0, atol=0)  # what an empty fp16 store gives
    fresh.close()
    again, sources = answer(new)
    assert sources == ["disk"] * 3  # its own fp16 entries now
    assert (again - fp32_logits).abs().max().item() <= 3e-3  # fp16 rounding of the stored KV, no more
    stats = new.store.stats()
    assert stats.errors == 0 and stats.entries == 6  # three fp32 entries kept beside three fp16 ones
    new.close()

    back = disk_engine(tmp_path / "kv", "fp32")
    logits, sources = answer(back)
    assert sources == ["disk"] * 3  # the old entries still load
    torch.testing.assert_close(logits, fp32_logits, rtol=0, atol=1e-5)
    assert set(old_files) <= {p.name for p in (tmp_path / "kv").rglob("*") if p.is_file()}
    back.close()


def test_the_settings_and_the_store_agree_on_the_default() -> None:
    from kvblend.settings import StoreSettings

    assert StoreSettings().kv_dtype == StoreConfig.kv_dtype == "fp16"
    assert StoreSettings().store_config().kv_dtype == "fp16"
