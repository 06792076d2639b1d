"""The chained hash of a full KV block, computed the same way in every process.

A block's hash covers its tokens and, through its parent's hash, every token before it, so equal hashes mean
equal prefixes. The engine's prefix cache finds blocks by it, workers name blocks by it in their KV events, the
tokenizer attaches a prompt's hashes to `preprocessed` and the scheduler matches them against its index of
which worker holds which block: one function, so that they can never disagree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq

_ROOT = b"conveyor-kv-root"


def chain_hash(parent: bytes | None, tokens: Seq[int]) -> bytes:
    """Hash of a full block: its tokens and, through `parent`, every token before it.

    blake2b (128-bit) so that a collision, which would silently reuse wrong K/V, is not a concern.
    """
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_block_hashes(token_ids: Seq[int], hashes: list[bytes], block_size: int, upto: int) -> None:
    """Append to `hashes` the chained hashes of full blocks of token_ids[:upto] not hashed yet."""
    for i in range(len(hashes), upto // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))


def block_hashes(token_ids: Seq[int], block_size: int) -> tuple[bytes, ...]:
    """The hashes of every full block of token_ids."""
    out: list[bytes] = []
    extend_block_hashes(token_ids, out, block_size, len(token_ids))
    return tuple(out)
