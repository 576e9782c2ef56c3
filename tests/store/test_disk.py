"""Disk tier: file format, restart, fault injection, crashes and concurrent processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from kvblend.store import DiskStore
from kvblend.store.disk import TMP_DIR, remove_stale_temp_files
from kvblend.store.entry import encode_chunk, header_fields

from tests.store.helpers import assert_same_chunk, hammer_in_processes, keyed, make_chunk

REPO = Path(__file__).resolve().parents[2]


def entry_path(store: DiskStore, i: int, **kw: object) -> tuple[DiskStore, Path]:
    key, chunk = keyed(i, **kw)  # type: ignore[arg-type]
    assert store.put(key, chunk)
    return store, store.path(key)


def test_entry_is_a_standard_safetensors_file_readable_layer_by_layer(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 30)
    key, chunk = keyed(1, layers=3)
    store.put(key, chunk)
    path = store.path(key)
    assert path.parent.parent.name == "default" and path.suffix == ".safetensors"
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["header"])
        assert header["token_ids"] == list(chunk.token_ids) and header["base_position"] == chunk.base_position
        assert header["model_fingerprint"] == "model-a" and header["digest"] == key.digest
        assert set(header["checksums"]) == set(f.keys())
        assert torch.equal(f.get_tensor("v.2"), chunk.values[2])


def test_index_is_rebuilt_on_start_with_recency(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, 1 << 30)
    pairs = [keyed(i) for i in range(3)]
    for n, (key, chunk) in enumerate(pairs):
        first.put(key, chunk)
        os.utime(first.path(key), (1000 + n, 1000 + n))
    os.utime(first.path(pairs[0][0]), (2000, 2000))  # 0 was used last
    unit = first.stats().bytes // 3
    second = DiskStore(tmp_path, 1 << 30)
    assert sorted(map(str, second.keys("default"))) == sorted(str(k) for k, _ in pairs)
    assert second.stats().bytes == first.stats().bytes
    assert_same_chunk(second.get(pairs[2][0]), pairs[2][1])  # type: ignore[arg-type]
    third = DiskStore(tmp_path, int(2.5 * unit))  # a smaller cap on restart evicts the oldest
    assert not third.contains(pairs[1][0]) and third.contains(pairs[0][0])


def test_a_smaller_cap_on_restart_trims_the_biggest_tenant_first(tmp_path: Path) -> None:
    """Not the globally oldest entries: bob's two, though older, are within half the tier."""
    first = DiskStore(tmp_path, 1 << 30, fsync=False)
    pairs = [keyed(i, tenant="bob") for i in range(10, 12)] + [keyed(i, tenant="alice") for i in range(20, 26)]
    for n, (key, chunk) in enumerate(pairs):
        first.put(key, chunk)
        os.utime(first.path(key), (1000 + n, 1000 + n))
    unit = max(first.path(key).stat().st_size for key, _ in pairs)
    second = DiskStore(tmp_path, 4 * unit + unit // 2, fsync=False)
    assert [second.contains(key) for key, _ in pairs] == [True, True] + [False] * 4 + [True, True]
    assert second.stats().bytes <= 4 * unit + unit // 2


def test_files_on_disk_stay_under_the_cap(tmp_path: Path) -> None:
    store, path = entry_path(DiskStore(tmp_path, 1 << 30), 0)
    cap = 3 * path.stat().st_size
    store = DiskStore(tmp_path / "capped", cap)
    for i in range(12):
        store.put(*keyed(i))
        files = list((tmp_path / "capped").glob("*/??/*.safetensors"))
        assert sum(f.stat().st_size for f in files) <= cap and len(files) <= 3


def test_truncated_file_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    store, path = entry_path(DiskStore(tmp_path, 1 << 30), 1)
    key = keyed(1)[0]
    for keep in (path.stat().st_size - 3, 100, 5, 0):
        store.put(*keyed(1))
        with open(path, "r+b") as f:
            f.truncate(keep)
        assert store.get(key) is None
        assert not path.exists() and not store.contains(key)
    assert store.stats().errors >= 4


def test_flipped_bytes_anywhere_are_caught(tmp_path: Path) -> None:
    store, path = entry_path(DiskStore(tmp_path, 1 << 30), 1)
    key, chunk = keyed(1)
    size = path.stat().st_size
    for offset in (3, 20, size // 2, size - 1):  # length, safetensors table, our header, tensor data
        store.put(key, chunk)
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x40
        path.write_bytes(bytes(data))
        got = store.get(key, chunk.token_ids)
        assert got is None, offset
        assert not path.exists()
    assert store.stats().errors == 4


def test_flipped_byte_in_one_layer_fails_that_layer_read(tmp_path: Path) -> None:
    store, path = entry_path(DiskStore(tmp_path, 1 << 30), 1, layers=2)
    key, _ = keyed(1, layers=2)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last byte belongs to the last tensor in the file
    path.write_bytes(bytes(data))
    results = [store.get_layer(key, layer) for layer in range(2)]
    assert None in results and not path.exists()


def test_wrong_model_file_under_the_right_name_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 30)
    ids = (5, 6, 7, 8)
    from kvblend.store.keys import chunk_key
    from tests.store.helpers import make_ctx

    key_a = chunk_key(ids, make_ctx(model="model-a"))
    key_b = chunk_key(ids, make_ctx(model="model-b"))
    store.put(key_b, make_chunk(ids))
    store.path(key_a).parent.mkdir(parents=True, exist_ok=True)
    os.replace(store.path(key_b), store.path(key_a))  # e.g. a file copied in by hand
    assert store.get(key_a, ids) is None and not store.path(key_a).exists()
    assert store.stats().errors == 1


def test_failed_write_leaves_nothing_visible(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 30)
    key, chunk = keyed(1)
    os.chmod(tmp_path / TMP_DIR, 0o500)  # cannot create the temporary file
    try:
        if os.access(tmp_path / TMP_DIR, os.W_OK):  # root ignores permissions: fill the name with a directory
            os.chmod(tmp_path / TMP_DIR, 0o700)
            (tmp_path / TMP_DIR).rmdir()
            (tmp_path / TMP_DIR).write_text("not a directory")
        assert store.put(key, chunk) is False
    finally:
        if (tmp_path / TMP_DIR).is_file():
            (tmp_path / TMP_DIR).unlink()
            (tmp_path / TMP_DIR).mkdir()
        os.chmod(tmp_path / TMP_DIR, 0o700)
    assert store.get(key) is None and not store.contains(key) and store.stats().warnings == 1


WRITER = """
import os, sys, time
from kvblend.store import DiskStore
from tests.store.helpers import keyed
store = DiskStore(sys.argv[1], 1 << 30, fsync=True)
key, chunk = keyed(1, layers=int(sys.argv[2]), heads=8, head_dim=64, n_tokens=256)
if sys.argv[3] == 'pause':
    real = os.fsync
    def slow_fsync(fd):
        print('writing', flush=True)
        time.sleep(60)
    os.fsync = slow_fsync
else:
    print('writing', flush=True)
store.put(key, chunk)
print('done', flush=True)
"""


def _spawn_writer(root: Path, layers: int, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(layers), mode], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    return proc


def test_process_killed_mid_write_leaves_no_visible_entry(tmp_path: Path) -> None:
    proc = _spawn_writer(tmp_path, 4, "pause")  # stops inside the write, temp file complete, not renamed
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    key, chunk = keyed(1, layers=4, heads=8, head_dim=64, n_tokens=256)
    assert list((tmp_path / TMP_DIR).glob("*.tmp"))  # the killed writer's leftovers
    store = DiskStore(tmp_path, 1 << 30)
    assert not store.contains(key) and store.get(key) is None and store.keys("default") == []
    assert list((tmp_path / TMP_DIR).glob("*.tmp")) == []  # swept on start: the writer is dead
    assert store.put(key, chunk) and store.get(key) is not None


def test_kill_at_a_random_moment_never_exposes_a_partial_entry(tmp_path: Path) -> None:
    proc = _spawn_writer(tmp_path, 24, "run")  # ~12 MB entry
    time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    key, chunk = keyed(1, layers=24, heads=8, head_dim=64, n_tokens=256)
    store = DiskStore(tmp_path, 1 << 30)
    got = store.get(key, chunk.token_ids)
    assert got is None or torch.equal(got.values[-1], chunk.values[-1])  # absent or whole, never partial
    assert store.stats().errors == 0


def test_stale_temp_files_of_live_writers_are_kept(tmp_path: Path) -> None:
    tmp = tmp_path / TMP_DIR
    tmp.mkdir()
    mine = tmp / f"{'a' * 64}.{os.getpid()}.x.tmp"
    dead = tmp / f"{'b' * 64}.999999999.x.tmp"
    mine.write_bytes(b"partial")
    dead.write_bytes(b"partial")
    assert remove_stale_temp_files(tmp) == 1 and mine.exists() and not dead.exists()


def test_concurrent_processes_never_see_torn_entries(tmp_path: Path) -> None:
    results = hammer_in_processes(f"DiskStore({str(tmp_path)!r}, 1 << 30, fsync=False)", read_layers=False)
    assert all(torn == 0 and errors == 0 for torn, _, errors in results), results
    assert sum(hits for _, hits, _ in results) > 0


def test_entries_written_by_another_process_are_adopted(tmp_path: Path) -> None:
    a = DiskStore(tmp_path, 1 << 30)
    b = DiskStore(tmp_path, 1 << 30)
    key, chunk = keyed(1)
    a.put(key, chunk)
    assert b.contains(key) and b.get(key) is not None and b.keys("default") == [key]


def test_an_entry_larger_than_this_process_cap_is_served_but_not_counted(tmp_path: Path) -> None:
    """Another process with a larger cap wrote it: serving it is fine, but counting it would
    put this tier over its cap until its next put."""
    key, chunk = keyed(1)
    probe = DiskStore(tmp_path / "probe", 1 << 30)
    probe.put(key, chunk)
    size = probe.path(key).stat().st_size
    small = DiskStore(tmp_path / "shared", size - 1)
    big = DiskStore(tmp_path / "shared", 1 << 30)
    big.put(key, chunk)
    assert small.get(key) is not None and small.get(key) is not None
    assert small.stats().bytes <= size - 1 and small.keys("default") == []
    assert big.path(key).is_file()  # the writer's entry stays: its writer accounts for it


def test_header_fields_live_in_the_file_metadata(tmp_path: Path) -> None:
    store, path = entry_path(DiskStore(tmp_path, 1 << 30), 1)
    key, chunk = keyed(1)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    expected = header_fields(encode_chunk(key, chunk, "fp32").header)
    assert meta["format"] == expected["format"]
    assert json.loads(meta["header"])["checksums"] == json.loads(expected["header"])["checksums"]
