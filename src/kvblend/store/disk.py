"""Local-disk tier: one safetensors file per chunk, written atomically, read layer by layer.

Layout: ``root/<tenant>/<digest[:2]>/<digest>.safetensors``; temporary files live in
``root/.tmp`` (tenant names cannot start with a dot). A write goes to a temporary file,
is fsynced, then renamed into place, so a reader sees either no entry or a complete one,
and a process killed mid-write leaves only a temporary file, removed on the next start.
The safetensors metadata holds the entry header (token ids, context, base position,
per-tensor xxh3 checksums); one layer is read without touching the others (the files are
standard safetensors: ``safe_open`` can map them and read any layer alone). The index (sizes, recency from file mtimes) is
rebuilt from the directory on start; entries other processes add are adopted when seen.
The byte cap counts file sizes of the entries this process knows.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from safetensors import SafetensorError
from safetensors.torch import save_file

from kvblend.store.entry import CorruptEntry, Entry, header_fields, parse_header_fields, verify_tensor
from kvblend.store.keys import ChunkKey
from kvblend.store.policy import EvictionPolicy
from kvblend.store.tier import IndexedTier, LayerRead, TierUnavailable, WriteOutcome

SUFFIX = ".safetensors"
TMP_DIR = ".tmp"
STALE_TMP_S = 3600.0


class DiskStore(IndexedTier):
    """Chunk files under ``root``, at most ``max_bytes`` of them (see the module docstring).

    Thread-safe; several processes may share ``root`` (atomic renames keep reads whole),
    but each enforces the cap over the entries it knows.
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, policy: EvictionPolicy | None = None,
                 tenant_bytes: int | None = None, kv_dtype: str = "fp32", compute_dtype: str = "fp32",
                 fsync: bool = True, create: bool = True) -> None:
        """``create``: make ``root`` and its temporary folder (a serving tier); False opens an
        existing store without adding anything to the folder (``kvblend store``: it lists and
        deletes entries, and a folder given by mistake must not gain a ``.tmp``)."""
        super().__init__(max_bytes, policy=policy, tenant_bytes=tenant_bytes, kv_dtype=kv_dtype,
                         compute_dtype=compute_dtype)
        self.root = Path(root)
        self.fsync = fsync
        self._tmp = self.root / TMP_DIR
        if create:
            self._tmp.mkdir(parents=True, exist_ok=True)
            remove_stale_temp_files(self._tmp)
        self._rebuild_index()

    # -- paths and index ---------------------------------------------------------------

    def path(self, key: ChunkKey) -> Path:
        return self.root / key.tenant / key.digest[:2] / f"{key.digest}{SUFFIX}"

    def _rebuild_index(self) -> None:
        found = sorted(scan_entries(self.root), key=lambda item: item[2])  # oldest first
        with self._lock:
            for key, size, mtime in found:
                self._index.add(key, size, last_used=mtime)
            for victim in self._index.over_cap():  # the cap shrank: fair shares, LRU within each
                self._delete_locked(victim)

    def _adopt(self, key: ChunkKey, path: Path) -> None:
        """Index an entry another process wrote, evicting entries to fit it as a put would.
        One this process would not take in (larger than a cap, or only by evicting past
        the fair shares, ``ByteIndex.victims_for``) is served but not indexed: its writer
        accounts for it, and counting it here would hold this tier over its cap. Each hit
        on it tries again (a stat and the victims' check)."""
        try:
            size = path.stat().st_size
        except OSError:  # removed again meanwhile
            return
        with self._lock:
            if key in self._index:
                return
            victims = self._index.victims_for(key, size)
            if victims is None:
                return
            for victim in victims:
                self._delete_locked(victim)
            self._index.add(key, size)

    def _touch(self, key: ChunkKey, path: Path) -> None:
        with self._lock:
            self._index.touch(key)
        try:
            os.utime(path)  # recency survives restarts
        except OSError:
            pass

    def _delete_locked(self, key: ChunkKey) -> None:
        """Forget and delete an entry; caller holds the lock."""
        self._index.remove(key)
        self.path(key).unlink(missing_ok=True)

    # -- reads -------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self.path(key).is_file()

    def _read(self, key: ChunkKey) -> Entry | None:
        read = self._read_file(key, None)
        if read is None:
            return None
        self._after_hit(key, self.path(key))
        return Entry(read.header, read.tensors, owned=True)

    def _read_layer(self, key: ChunkKey, layer: int) -> LayerRead | None:
        read = self._read_file(key, layer)
        if read is not None:
            with self._lock:
                self._index.touch(key)
        return read

    def _read_file(self, key: ChunkKey, layer: int | None) -> LayerRead | None:
        """Verified tensors of one layer (or all when None); None when absent or out of range."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                reader = SafetensorsReader(f.fileno())
                header = parse_header_fields(reader.metadata)
                if layer is not None and layer >= header.n_layers:
                    return None
                names = list(header.checksums) if layer is None else header.tensor_names(layer)
                tensors = reader.read(names, lambda name, t: verify_tensor(header, name, t))
        except FileNotFoundError:
            self._forget(key)
            return None
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise _corrupt_or_unavailable(path, exc) from exc
        return LayerRead(header, tensors, owned=True)

    def _after_hit(self, key: ChunkKey, path: Path) -> None:
        with self._lock:
            known = key in self._index
        if known:
            self._touch(key, path)
        else:
            self._adopt(key, path)

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._index.remove(key)

    # -- writes ------------------------------------------------------------------------

    def _write(self, entry: Entry) -> WriteOutcome:
        key = ChunkKey(entry.header.tenant, entry.header.digest)
        if not self._index.fits(entry.nbytes):
            return WriteOutcome(False)
        tmp = self._write_temp(entry)
        try:
            return self._commit(key, tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_temp(self, entry: Entry) -> Path:
        tmp = self._tmp / f"{entry.header.digest}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            save_file(dict(entry.tensors), str(tmp), metadata=header_fields(entry.header))
            if self.fsync:
                _fsync_path(tmp)
        except (SafetensorError, OSError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            raise TierUnavailable(f"cannot write {tmp}: {exc}") from exc
        return tmp

    def _commit(self, key: ChunkKey, tmp: Path) -> WriteOutcome:
        size = tmp.stat().st_size
        final = self.path(key)
        with self._lock:
            victims = self._index.victims_for(key, size)
            if victims is None:
                return WriteOutcome(False)
            for victim in victims:
                self._delete_locked(victim)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            self._index.add(key, size)
        if self.fsync:
            _fsync_path(final.parent)
        return WriteOutcome(True, tuple(v.tenant for v in victims))

    def _remove(self, key: ChunkKey) -> bool:
        path = self.path(key)
        with self._lock:
            known = self._index.remove(key) is not None
            try:
                path.unlink()
            except FileNotFoundError:
                return known
        return True

    # -- accounting --------------------------------------------------------------------


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}


class SafetensorsReader:
    """Reads chosen tensors of a safetensors file into one private buffer, one ``pread``
    per tensor, handing each to ``check`` right after its read (while it is in cache).

    Whole chunks and single layers are read this way rather than through a memory map:
    no mapping is set up per call, only the requested byte ranges are read, and the
    returned tensors are views of a buffer nobody else holds, so they can be handed out
    without another copy. The files stay plain safetensors (``safe_open`` reads them).
    ValueError/KeyError/RuntimeError on a malformed or truncated file.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.size = os.fstat(fd).st_size
        n = int.from_bytes(_pread(fd, 0, 8), "little")
        if n > self.size - 8:
            raise ValueError("bad safetensors header length")
        self._table = _parse_table(_pread(fd, 8, n))
        self._base = 8 + n
        self.metadata: dict[str, str] = self._table.get("__metadata__") or {}

    def read(self, names: Sequence[str], check: Callable[[str, torch.Tensor], None]) -> dict[str, torch.Tensor]:
        spans = [self._span(name) for name in names]
        buf = torch.empty(sum(end - begin for _, begin, end in spans), dtype=torch.uint8)
        view, pos, out = memoryview(buf.numpy()), 0, {}
        for name, begin, end in spans:
            _pread_into(self._fd, view[pos : pos + end - begin], begin)
            info = self._table[name]
            tensor = buf[pos : pos + end - begin].view(_ST_DTYPES[info["dtype"]]).view([int(d) for d in info["shape"]])
            check(name, tensor)
            out[name] = tensor
            pos += end - begin
        return out

    def _span(self, name: str) -> tuple[str, int, int]:
        begin, end = (self._base + int(o) for o in self._table[name]["data_offsets"])
        if not self._base <= begin <= end <= self.size:
            raise ValueError(f"{name}: data outside the file")
        return name, begin, end


@lru_cache(maxsize=256)
def _parse_table(raw: bytes) -> dict[str, Any]:
    """The safetensors header table (cached: per-layer reads of one file parse it once).
    Callers must not modify it."""
    table = json.loads(raw)
    if not isinstance(table, dict):
        raise ValueError("safetensors header is not an object")
    return table


def _pread(fd: int, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ValueError("file shorter than its header says")
    return data


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError("file shorter than its header says")
        done += got


def _corrupt_or_unavailable(path: Path, exc: Exception) -> Exception:
    """An unparsable file is corrupt; an I/O error on a readable-looking one is not ours to delete."""
    if isinstance(exc, OSError) and not isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return TierUnavailable(f"{path}: {exc}")
    return CorruptEntry(f"{path}: {exc}")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan_entries(root: Path) -> list[tuple[ChunkKey, int, float]]:
    """(key, file size, mtime) of every well-named entry file under ``root``."""
    found = []
    for path in root.glob(f"*/??/*{SUFFIX}"):
        tenant, digest = path.parent.parent.name, path.name[: -len(SUFFIX)]
        try:
            key = ChunkKey(tenant, digest)
            st = path.stat()
        except (ValueError, OSError):
            continue
        if path.parent.name == digest[:2]:
            found.append((key, st.st_size, st.st_mtime))
    return found


def remove_stale_temp_files(tmp_dir: Path, max_age_s: float = STALE_TMP_S) -> int:
    """Delete temporary files of dead writers (or older than ``max_age_s``); returns the count."""
    removed = 0
    for path in tmp_dir.glob("*.tmp"):
        if _writer_alive(path) and time.time() - _mtime(path) < max_age_s:
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _writer_alive(path: Path) -> bool:
    try:
        pid = int(path.name.split(".")[1])
        os.kill(pid, 0)
    except (IndexError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return pid != 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
