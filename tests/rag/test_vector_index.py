"""The embedded vector index: tenant scoping, deletes, durability across reopen and crash,
the exact-to-IVF switch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvblend.rag.faiss_index import FaissIndex
from kvblend.rag.backends import build_vector_index

ROOT = Path(__file__).resolve().parents[2]


def _unit(rng, n, dim=16):
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_search_is_scoped_by_tenant_and_deletes_work(tmp_path):
    rng = np.random.default_rng(0)
    idx = build_vector_index("faiss", tmp_path, 16)
    a, b = _unit(rng, 5), _unit(rng, 5)
    idx.upsert("t1", [f"a{i}" for i in range(5)], a)
    idx.upsert("t2", [f"b{i}" for i in range(5)], b)
    assert idx.search("t1", a[3], 1)[0].chunk_id == "a3"
    assert {h.chunk_id for h in idx.search("t1", b[0], 10)} == {f"a{i}" for i in range(5)}
    assert (idx.count("t1"), idx.count("t2"), idx.count("t3")) == (5, 5, 0)
    assert idx.delete("t1", ["a3", "zz"]) == 1
    assert "a3" not in {h.chunk_id for h in idx.search("t1", a[3], 10)}
    assert idx.count("t2") == 5
    idx.upsert("t1", ["a0"], b[:1])  # replace a vector in place
    assert idx.count("t1") == 4 and idx.search("t1", b[0], 1)[0].chunk_id == "a0"
    with pytest.raises(ValueError):
        idx.upsert("t1", ["x"], np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError):
        idx.search("../x", a[0], 1)


def test_reopen_uses_snapshot_or_rebuilds_after_a_crash(tmp_path):
    rng = np.random.default_rng(1)
    vecs = _unit(rng, 20)
    idx = FaissIndex(tmp_path, 16)
    idx.upsert("t", [str(i) for i in range(10)], vecs[:10])
    idx.close()  # snapshot written
    idx = FaissIndex(tmp_path, 16)
    assert idx.count("t") == 10
    idx.upsert("t", [str(i) for i in range(10, 20)], vecs[10:])  # durable, no snapshot: a "crash"
    del idx
    idx = FaissIndex(tmp_path, 16)  # stale snapshot -> rebuilt from the log
    assert idx.count("t") == 20 and idx.search("t", vecs[15], 1)[0].chunk_id == "15"


def test_switches_to_ivf_above_the_threshold_and_stays_accurate(tmp_path):
    rng = np.random.default_rng(2)
    centers = _unit(rng, 40, 32)
    vecs = centers[rng.integers(0, 40, 3000)] + 0.05 * rng.standard_normal((3000, 32)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx = FaissIndex(tmp_path, 32, ivf_min=1000)
    for s in range(0, 3000, 500):
        idx.upsert("t", [str(i) for i in range(s, s + 500)], vecs[s : s + 500])
    assert idx._tenant("t").trained_at > 0  # an IVF index now
    found = sum(idx.search("t", vecs[i], 1)[0].chunk_id == str(i) for i in range(0, 3000, 60))
    assert found >= 48  # of 50
    idx.delete("t", ["0"])
    assert idx.count("t") == 2999 and idx.search("t", vecs[0], 1)[0].chunk_id != "0"
    idx.close()
    assert FaissIndex(tmp_path, 32, ivf_min=1000).count("t") == 2999


def test_a_reader_open_across_an_ingest_sees_its_vectors(tmp_path):
    """The server keeps one index open for its lifetime while `kvblend ingest` writes the
    folder from another process: a tenant's in-memory index follows the log (from the
    writer's snapshot once it flushes; rebuilt while the tenant's index is exact), so a
    chunk ingested after the server started is found, and one deleted is not."""
    rng = np.random.default_rng(3)
    vecs = _unit(rng, 200)
    writer = FaissIndex(tmp_path, 16, ivf_min=100)
    writer.upsert("t", [str(i) for i in range(5)], vecs[:5])
    writer.flush()
    reader = FaissIndex(tmp_path, 16, ivf_min=100)
    assert reader.search("t", vecs[7], 1)[0].chunk_id != "7" and reader.count("t") == 5
    writer.upsert("t", [str(i) for i in range(5, 10)], vecs[5:10])  # not flushed yet: rebuilt (exact)
    assert reader.search("t", vecs[7], 1)[0].chunk_id == "7"
    writer.delete("t", ["7"])
    writer.flush()
    assert "7" not in {h.chunk_id for h in reader.search("t", vecs[7], 10)} and reader.count("t") == 9
    writer.upsert("t", [str(i) for i in range(10, 200)], vecs[10:])  # an IVF index now (199 >= 100)
    assert reader.count("t") == 9  # no snapshot of it yet: the reader keeps what it has, no training per search
    writer.flush()
    assert reader.count("t") == 199 and reader._tenant("t").trained_at == 199
    assert reader.count("t2") == 0
    writer.upsert("t2", ["x"], vecs[:1])
    assert reader.count("t2") == 1
    writer.close()
    reader.close()


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
from kvblend.rag.faiss_index import FaissIndex
folder, vecs = sys.argv[1], np.load(sys.argv[2])
writer = FaissIndex(folder, 16, ivf_min=100)
writer.upsert("t", [str(i) for i in range(200, 300)], vecs[200:300])
writer.delete("t", ["5"])
os.kill(os.getpid(), signal.SIGKILL)  # killed before its flush: the log moved, no snapshot of it
"""


def _kill_a_writer(folder, vecs):
    np.save(folder / "vecs.npy", vecs)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(folder), str(folder / "vecs.npy")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def test_a_reader_recovers_an_ivf_tenant_whose_writer_was_killed(tmp_path):
    """A killed `kvblend ingest` never writes the snapshot an IVF tenant's reader waits for:
    once no writer holds changes it has not flushed, the reader rebuilds the tenant from the
    log (keeping its IVF training), so chunks added since are found and deleted ones are
    not; its close writes the snapshot, which the next open reads."""
    rng = np.random.default_rng(4)
    vecs = _unit(rng, 300)
    writer = FaissIndex(tmp_path, 16, ivf_min=100)
    writer.upsert("t", [str(i) for i in range(200)], vecs[:200])
    writer.close()
    reader = FaissIndex(tmp_path, 16, ivf_min=100)
    assert reader.count("t") == 200 and reader._tenant("t").trained_at == 200
    _kill_a_writer(tmp_path, vecs)
    assert reader.search("t", vecs[250], 1)[0].chunk_id == "250"
    assert "5" not in {h.chunk_id for h in reader.search("t", vecs[5], 20)}
    assert reader.count("t") == 299 and reader._tenant("t").trained_at == 200  # not trained per search
    reader.close()
    again = FaissIndex(tmp_path, 16, ivf_min=100)
    assert again._load_snapshot("t") is not None and again.count("t") == 299
    again.close()
