"""The disk tier of swapped-out KV: round trips, the byte bound, and every damaged file read as a miss."""

from __future__ import annotations

import os

import numpy as np
import pytest

from services.worker.engine.kv import kv_tier
from services.worker.engine.kv.kv_tier import SUFFIX, DiskTier, TierBusyError

HASHES = [bytes([i]) * 16 for i in range(4)]
MB = 1 << 20


def payload(n: int = 8192, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def tier(tmp_path):
    with DiskTier(tmp_path / "tier", MB) as t:
        yield t


def entry_file(t: DiskTier):
    (path,) = t.directory.glob("*" + SUFFIX)
    return path


def test_an_entry_reads_back_with_its_hashes_and_payload(tier):
    data = payload()
    assert tier.put("session-1", HASHES, data)
    got = tier.get("session-1")
    assert got is not None
    assert got.block_hashes == HASHES
    assert np.array_equal(got.payload, data)
    assert tier.keys() == ["session-1"] and tier.num_entries == 1
    assert tier.bytes_used == entry_file(tier).stat().st_size


def test_an_entry_put_in_parts_reads_back_as_their_concatenation(tier):
    data = payload(10_000)
    parts = [data[:1], data[1:4096], data[4096:]]
    assert tier.put_parts("s", HASHES, data.nbytes, iter(parts))
    got = tier.get("s")
    assert got is not None and got.block_hashes == HASHES and np.array_equal(got.payload, data)


@pytest.mark.parametrize("nbytes", [9_999, 10_001], ids=["parts-too-long", "parts-too-short"])
def test_parts_that_do_not_add_up_are_refused_and_the_older_entry_stays(tier, nbytes):
    old = payload(100, seed=1)
    assert tier.put("s", HASHES, old)
    used = tier.bytes_used
    with pytest.raises(ValueError):
        tier.put_parts("s", HASHES, nbytes, iter([payload(10_000)]))
    assert np.array_equal(tier.get("s").payload, old)
    assert tier.bytes_used == used and len(list(tier.directory.glob("*"))) == 2  # the entry and tier.lock


def test_a_part_producer_that_fails_leaves_no_file_and_the_older_entry(tier):
    old = payload(100, seed=1)
    assert tier.put("s", HASHES, old)

    def parts():
        yield payload(10)
        raise RuntimeError("the pool's gather failed")

    with pytest.raises(RuntimeError):
        tier.put_parts("s", HASHES, 20, parts())
    assert np.array_equal(tier.get("s").payload, old)
    assert len(list(tier.directory.glob("*"))) == 2  # the entry and tier.lock: no temp file left


def test_bytes_memoryview_and_typed_arrays_are_stored_as_their_bytes(tier):
    floats = np.linspace(0, 1, 300, dtype=np.float32).reshape(3, 100)
    for key, value in [("b", b"abc" * 100), ("m", memoryview(b"xyz" * 7)), ("f", floats)]:
        assert tier.put(key, [], value)
        got = tier.get(key)
        assert got is not None and got.block_hashes == []
        expected = value.tobytes() if isinstance(value, np.ndarray) else bytes(value)
        assert got.payload.tobytes() == expected


def test_an_empty_payload_round_trips(tier):
    assert tier.put("empty", HASHES[:1], b"")
    got = tier.get("empty")
    assert got is not None and got.block_hashes == HASHES[:1] and got.payload.size == 0


def test_a_read_payload_stays_valid_after_its_entry_is_dropped(tier):
    data = payload()
    tier.put("s", HASHES, data)
    got = tier.get("s")
    tier.drop("s")
    assert np.array_equal(got.payload, data)


@pytest.mark.parametrize("where", ["payload", "hashes", "header"])
def test_a_corrupted_byte_makes_get_miss_and_deletes_the_file(tier, where):
    tier.put("s", HASHES, payload())
    path = entry_file(tier)
    raw = bytearray(path.read_bytes())
    index = {"payload": len(raw) - 100, "hashes": 28 + len("s") + 5, "header": 8}[where]
    raw[index] ^= 0x01
    path.write_bytes(bytes(raw))
    assert tier.get("s") is None
    assert not path.exists()
    assert tier.num_entries == 0 and tier.bytes_used == 0


def test_a_missing_file_makes_get_miss(tier):
    tier.put("s", HASHES, payload())
    entry_file(tier).unlink()
    assert tier.get("s") is None
    assert tier.num_entries == 0 and tier.bytes_used == 0


def test_an_unknown_key_is_a_miss(tier):
    assert tier.get("nobody") is None


@pytest.mark.parametrize("keep", [10, 4096, 4096 + 8000])
def test_a_truncated_file_makes_get_miss_and_deletes_it(tier, keep):
    tier.put("s", HASHES, payload())
    path = entry_file(tier)
    os.truncate(path, keep)
    assert tier.get("s") is None
    assert not path.exists() and tier.bytes_used == 0


def test_a_put_over_max_bytes_stores_nothing_and_evicts_nobody(tmp_path):
    with DiskTier(tmp_path, 3 * 8192) as tier:
        assert tier.put("a", HASHES, payload(8192))
        used = tier.bytes_used
        assert not tier.put("b", HASHES, payload(3 * 8192))
        assert tier.bytes_used == used and tier.keys() == ["a"]
        assert tier.get("b") is None and tier.get("a") is not None
        assert len(list(tmp_path.glob("*" + SUFFIX))) == 1
        assert not list(tmp_path.glob("*.tmp"))


def test_replacing_an_entry_counts_only_the_new_one(tier):
    tier.put("s", HASHES, payload(8192))
    tier.put("s", HASHES[:2], payload(20000, seed=1))
    assert tier.num_entries == 1
    assert tier.bytes_used == entry_file(tier).stat().st_size
    got = tier.get("s")
    assert got.block_hashes == HASHES[:2] and np.array_equal(got.payload, payload(20000, seed=1))


def test_a_replacement_fits_in_the_space_its_old_entry_frees(tmp_path):
    with DiskTier(tmp_path, 4096 + 10000) as tier:
        assert tier.put("s", HASHES, payload(10000))
        assert tier.put("s", HASHES, payload(10000, seed=2)), "the old entry's bytes are given back"
        assert np.array_equal(tier.get("s").payload, payload(10000, seed=2))


def test_a_replacement_that_does_not_fit_keeps_the_old_entry(tmp_path):
    with DiskTier(tmp_path, 4096 + 10000) as tier:
        tier.put("s", HASHES, payload(10000))
        used = tier.bytes_used
        assert not tier.put("s", HASHES, payload(10001))
        assert tier.bytes_used == used
        assert np.array_equal(tier.get("s").payload, payload(10000))


def test_a_failed_write_leaves_the_tier_as_it_was(tier, monkeypatch):
    tier.put("s", HASHES, payload())
    used = tier.bytes_used

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_tier.os, "replace", full_disk)
    assert not tier.put("s", HASHES, payload(seed=3))
    assert tier.bytes_used == used and not list(tier.directory.glob("*.tmp"))
    monkeypatch.undo()
    assert np.array_equal(tier.get("s").payload, payload())


def test_drop_removes_the_entry_and_its_file(tier):
    tier.put("a", HASHES, payload())
    tier.put("b", HASHES, payload())
    assert tier.drop("a")
    assert not tier.drop("a")
    assert tier.keys() == ["b"] and tier.get("a") is None
    assert tier.bytes_used == entry_file(tier).stat().st_size


def test_file_names_never_contain_the_key(tier):
    key = "../../etc/passwd"
    assert tier.put(key, HASHES, payload())
    path = entry_file(tier)
    assert path.parent == tier.directory and "passwd" not in path.name
    assert tier.get(key) is not None


def test_stale_files_are_removed_at_construction_and_other_files_kept(tmp_path):
    first = DiskTier(tmp_path, MB)
    first.put("s", HASHES, payload())
    (tmp_path / ("0" * 32 + SUFFIX + ".tmp")).write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("not the tier's")
    os.close(first._lock_fd)  # the owner dies without cleaning up: its lock goes, its files stay
    with DiskTier(tmp_path, MB) as second:
        assert second.num_entries == 0 and second.bytes_used == 0
        assert not list(tmp_path.glob("*" + SUFFIX)) and not list(tmp_path.glob("*.tmp"))
        assert (tmp_path / "notes.txt").exists()


def test_a_second_tier_on_a_directory_in_use_is_refused(tier):
    with pytest.raises(TierBusyError):
        DiskTier(tier.directory, MB)
    assert tier.get("nothing") is None  # the first is untouched


def test_close_removes_the_files_and_frees_the_directory(tmp_path):
    tier = DiskTier(tmp_path, MB)
    tier.put("s", HASHES, payload())
    tier.close()
    assert not list(tmp_path.glob("*" + SUFFIX))
    DiskTier(tmp_path, MB).close()


def test_hashes_of_different_lengths_are_refused(tier):
    with pytest.raises(ValueError):
        tier.put("s", [b"a" * 16, b"b" * 8], payload())
    assert tier.num_entries == 0


def test_abandoned_tier_folders_are_removed_and_live_or_new_ones_kept(tmp_path):
    live = DiskTier(tmp_path / "live", 1 << 20)
    dead = DiskTier(tmp_path / "dead", 1 << 20)
    dead.put("s", [b"h" * 16], b"\0" * 64)
    dead.close()  # its process died: the lock is free
    new = tmp_path / "new"
    new.mkdir()  # just made by a starting process, not locked yet
    old = 1_000_000_000
    for d in (tmp_path / "live", tmp_path / "dead"):
        os.utime(d, (old, old))
    assert kv_tier.remove_abandoned(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "new"]
    live.close()
