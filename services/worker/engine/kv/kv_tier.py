"""The KV cache's second tier: the K/V of paused sessions' block runs in files on local disk, bounded in bytes.

A worker under KV pressure moves a paused session's blocks here (runner.read_slabs, then DiskTier.put_parts)
instead of dropping them, and brings them back when the session's next turn arrives (DiskTier.get, then
runner.write_blocks, into whichever blocks are free then). An entry is keyed by a string (a session id) and holds
the chained hashes of the blocks it covers and their K/V as one opaque payload (the runner's layout: the tier
never interprets it).

One file per entry, `<blake2b(key)>.kv` (never the raw key: a key is client-controlled text, not a path):

    fixed header  magic "CVKV", version, hash length, number of hashes, key length, payload length
    checksum      xxh3-64 of everything else in the file (header fields, key, hashes, payload); xxh3 rather than
                  crc32: 21 GB/s against 2.4 on a Xeon of docs/benchmarks.md, where crc32 was most of a swap's
                  cost (31 of the ~45 ms writing and ~35 ms reading a 70 MB session)
    key, hashes   utf-8 key, then the hashes back to back
    padding       to a page boundary, so the payload maps page-aligned
    payload

Written to `<name>.tmp` and renamed over the real name, so the real name never holds a half-written entry. The
files are not fsynced: the tier's content never outlives the process (a worker restarting finds its blocks
gone anyway, and removes the files at construction), so durability would be paid for and never used.

A failed checksum, a truncated or unreadable file is logged, deleted and reported as a miss (None): the caller
recomputes the session's prefix, as it would had the tier dropped it.

Not for sharing: the directory belongs to one tier of one process (an exclusive lock on `tier.lock` there, taken
at construction, refuses a second one; the lock dies with its process, so a restarted worker takes it back).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"CVKV"
VERSION = 2  # 2: the checksum is xxh3-64 (1: crc32)
SUFFIX = ".kv"
LOCK_NAME = "tier.lock"
_FIXED = struct.Struct("<4sHHIIQ")  # magic, version, hash length, number of hashes, key length, payload length
_SUM = struct.Struct("<Q")
_ALIGN = 4096  # payload offset: a page, so the mapping of the payload starts on one
# Slices of the payload checksummed and written one after the other: the payload is read from memory once, not
# once for the checksum and again for the write. 360 MiB (8k tokens of SmolLM2 KV), on a 2-core VM under load, with
# crc32 (the checksum then): one crc32 then one write() took 470-2,000 ms (median 1,334), 256 KiB slices 325-420 ms
# (median 345), 1 MiB 473.
_CHUNK = 256 << 10


class TierBusyError(RuntimeError):
    """Another live DiskTier (in this or another process) owns the directory."""


class CorruptEntryError(ValueError):
    """A tier file that is not a whole, intact entry of the key asked for."""


@dataclass(frozen=True)
class SwappedKV:
    block_hashes: list[bytes]
    # uint8, 1-D: a private copy-on-write mapping of the file (writing to it never changes the file); it stays
    # valid after the entry is dropped or replaced.
    payload: np.ndarray


@dataclass(frozen=True)
class _Entry:
    path: Path
    size: int  # bytes on disk: header, key, hashes, padding and payload


def _as_uint8(payload: bytes | memoryview | np.ndarray) -> np.ndarray:
    """The payload's bytes as a flat uint8 array, without a copy where the buffer is already contiguous."""
    if isinstance(payload, np.ndarray):
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return np.frombuffer(payload, dtype=np.uint8)


def _payload_offset(meta_len: int) -> int:
    head = _FIXED.size + _SUM.size + meta_len
    return -(-head // _ALIGN) * _ALIGN


def _encode_meta(key: str, block_hashes: list[bytes]) -> tuple[int, bytes]:
    """-> (the length of each hash, the key's utf-8 bytes followed by the hashes)."""
    hash_len = len(block_hashes[0]) if block_hashes else 0
    if any(len(h) != hash_len for h in block_hashes):
        raise ValueError("block hashes of one entry must all have the same length")
    return hash_len, key.encode("utf-8") + b"".join(block_hashes)


class DiskTier:
    def __init__(self, directory: Path, max_bytes: int):
        """directory: created if missing, owned by this tier from now on (stale entry files in it are removed);
        max_bytes: the most the tier's files may hold in all."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_directory()
        self._lock = threading.RLock()  # callers may swap from a thread of their own; file I/O is serialised
        self._entries: dict[str, _Entry] = {}
        self._bytes_used = 0
        self._remove_stale_files()

    def _take_directory(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            raise TierBusyError(f"{self.directory} is the KV tier of another live process (or DiskTier)") from e
        return fd

    def _remove_stale_files(self) -> None:
        """A previous owner's files: their KV belonged to a process that is gone, and nothing indexes them."""
        stale = [p for p in self.directory.iterdir() if p.name.endswith((SUFFIX, SUFFIX + ".tmp"))]
        for p in stale:
            p.unlink(missing_ok=True)
        if stale:
            logger.info("KV tier %s: removed %d stale files", self.directory, len(stale))

    def close(self) -> None:
        """Remove every entry and give the directory up."""
        with self._lock:
            self.clear()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- bookkeeping ----------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return self._bytes_used

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _path(self, key: str) -> Path:
        return self.directory / (hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest() + SUFFIX)

    # ---- entries --------------------------------------------------------------------------
    def put(self, key: str, block_hashes: list[bytes], payload: bytes | memoryview | np.ndarray) -> bool:
        """Store (or replace) the entry of key. False, and the tier exactly as it was (an older entry of key
        included), when it does not fit in max_bytes (counting the space the replaced entry frees) or cannot be
        written; the tier never evicts another entry to make room."""
        data = memoryview(_as_uint8(payload))
        return self.put_parts(
            key, block_hashes, data.nbytes, (data[i : i + _CHUNK] for i in range(0, data.nbytes, _CHUNK))
        )

    def put_parts(self, key: str, block_hashes: list[bytes], nbytes: int, parts: Iterable) -> bool:
        """put, with the payload given as its consecutive parts (buffers, each read once, in order, before the next
        is taken: a runner's staging buffer reused for every part, runner.read_slabs), nbytes in all. Parts that do
        not add up to nbytes raise ValueError and leave the tier as it was."""
        hash_len, meta = _encode_meta(key, block_hashes)
        key_len = len(meta) - hash_len * len(block_hashes)
        fixed = _FIXED.pack(MAGIC, VERSION, hash_len, len(block_hashes), key_len, nbytes)
        offset = _payload_offset(len(meta))
        size = offset + nbytes
        with self._lock:
            old = self._entries.get(key)
            after = self._bytes_used - (old.size if old else 0) + size
            if after > self.max_bytes:
                logger.debug(
                    "KV tier: %s (%d bytes) does not fit, %d of %d used", key, size, self._bytes_used, self.max_bytes
                )
                return False
            path = self._path(key)
            try:
                self._write(path, fixed, meta, offset, nbytes, parts)
            except OSError:
                logger.warning("KV tier: cannot write the entry of %s", key, exc_info=True)
                return False
            self._entries[key] = _Entry(path, size)
            self._bytes_used = after
            return True

    @staticmethod
    def _write(path: Path, fixed: bytes, meta: bytes, offset: int, nbytes: int, parts: Iterable) -> None:
        """Each part is checksummed then written while it is still in the cache; the checksum, known only at the
        end, is written into its place last."""
        # Plain write() rather than a writable memmap: on 100 MB it took 29 ms against 104 ms (a fresh mapping
        # page-faults every page of the new file); reads do map (get).
        digest = xxhash.xxh3_64(fixed)
        digest.update(meta)
        tmp = path.with_name(path.name + ".tmp")
        written = 0
        try:
            with open(tmp, "wb") as f:
                head = fixed + _SUM.pack(0) + meta
                f.write(head + bytes(offset - len(head)))
                for part in parts:
                    digest.update(part)
                    written += f.write(part)
                if written != nbytes:
                    raise ValueError(f"KV tier: parts of {written} bytes for a payload of {nbytes}")
                f.seek(_FIXED.size)
                f.write(_SUM.pack(digest.intdigest()))
            os.replace(tmp, path)
        except BaseException:  # a failing disk, parts that do not add up, or a part's own producer failing
            tmp.unlink(missing_ok=True)  # a half-written temp file must not linger (it counts on no budget)
            raise

    def get(self, key: str) -> SwappedKV | None:
        """The entry of key, checksum verified; None when there is none, or its file is missing, unreadable,
        truncated or corrupt (then it is logged and deleted). The entry stays in the tier (drop removes it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            try:
                return _read(entry.path, key)
            except (OSError, CorruptEntryError) as e:
                logger.warning("KV tier: dropping the entry of %s: %s", key, e)
                self._remove(key)
                return None

    def drop(self, key: str) -> bool:
        """Remove the entry of key (and its file); False if there was none."""
        with self._lock:
            if key not in self._entries:
                return False
            self._remove(key)
            return True

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._remove(key)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes_used -= entry.size
        entry.path.unlink(missing_ok=True)


def _read(path: Path, key: str) -> SwappedKV:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        fixed = f.read(_FIXED.size)
        if len(fixed) < _FIXED.size:
            raise CorruptEntryError(f"{path.name}: {size} bytes, shorter than a header")
        magic, version, hash_len, num_hashes, key_len, payload_len = _FIXED.unpack(fixed)
        if magic != MAGIC or version != VERSION:
            raise CorruptEntryError(f"{path.name}: not a version {VERSION} tier file ({magic!r}, {version})")
        meta_len = key_len + hash_len * num_hashes
        offset = _payload_offset(meta_len)
        if size != offset + payload_len:
            raise CorruptEntryError(f"{path.name}: {size} bytes, its header says {offset + payload_len}")
        (expected,) = _SUM.unpack(f.read(_SUM.size))
        meta = f.read(meta_len)
    # mode "c": a private mapping, writable without touching the file, so torch.from_numpy takes it as is
    payload = np.memmap(path, dtype=np.uint8, mode="c", offset=offset) if payload_len else np.empty(0, np.uint8)
    digest = xxhash.xxh3_64(fixed)
    digest.update(meta)
    digest.update(memoryview(payload))
    if digest.intdigest() != expected:
        raise CorruptEntryError(f"{path.name}: checksum mismatch")
    if meta[:key_len].decode("utf-8", errors="replace") != key:
        raise CorruptEntryError(f"{path.name}: holds another key's entry")
    hashes = meta[key_len:]
    return SwappedKV([hashes[i * hash_len : (i + 1) * hash_len] for i in range(num_hashes)], payload)


def remove_abandoned(parent: Path, min_age_s: float = 60.0) -> int:
    """Remove the tier folders under `parent` that no live tier holds (their processes died: nobody will read their
    files again, and each start makes a folder of its own, so without this they would pile up). A folder changed in
    the last min_age_s is left alone: it may be one a starting process made and has not locked yet. -> removed."""
    removed, now = 0, time.time()
    for d in parent.iterdir() if parent.is_dir() else ():
        if not d.is_dir() or now - d.stat().st_mtime < min_age_s:
            continue
        try:
            fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            logger.warning("cannot check the KV tier folder %s: %s", d, e)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live tier's
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    if removed:
        logger.info("removed %d abandoned KV tier folders under %s", removed, parent)
    return removed
