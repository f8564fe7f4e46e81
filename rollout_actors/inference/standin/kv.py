"""The stand-in's KV cache: fixed-size blocks, a prefix cache over them, and LRU eviction.

Modelled on vLLM 0.33's `vllm/v1/core/block_pool.py` and `kv_cache_manager.py`, where the plane can see
the difference (load, preemption, prefix-cache hits):

- The cache is `num_blocks` blocks of `BLOCK_SIZE` tokens. A request holds the blocks its tokens fill,
  the last one partly; usage is the held fraction (`get_usage`: 1 - free / total).
- A **full** block is cached under a hash chained from the start of the sequence (the parent's hash, the
  block's token ids and the extra keys: the adapter's name in every block, `cache_salt` in the first),
  so two requests share a block only when everything before it is the same.
- A freed block keeps its hash and joins the tail of the free queue; a later request whose chain finds
  it takes it back (a prefix-cache hit). Allocation pops the head of the free queue and drops the hash of
  what it pops: the least recently freed blocks no request holds are evicted first. A request frees its
  blocks tail first, so its deepest blocks, the least likely to be shared, go first.

Single event loop: plain state, no locks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_SIZE = 16  # vLLM's default `--block-size` on CUDA
ROOT_HASH = b"standin-kv"  # parent of a sequence's first block (vLLM: a random seed per process)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def chain_hashes(
    token_ids: Sequence[int], extra: tuple[str, ...], salt: str | None, start: int = 0, parent: bytes = b""
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block `start` on, each chained to the one before
    (`parent`: the hash of block `start - 1`, or nothing for the first)."""
    hashes: list[bytes] = []
    parent = parent or ROOT_HASH
    keys = "\x1f".join(extra).encode()
    width = BLOCK_SIZE * 8
    raw = array("q", token_ids[start * BLOCK_SIZE :]).tobytes()
    for index in range(len(raw) // width):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(raw[index * width : (index + 1) * width])
        digest.update(keys)
        if start + index == 0 and salt is not None:
            digest.update(b"\x1e" + salt.encode())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """Blocks, their reference counts, the free queue (LRU first) and the hash -> block map.

    pool = BlockPool(num_blocks=512)
    hit = pool.longest_hit(hashes)   # cached blocks for the leading hashes
    pool.take(hit)                   # hold them (out of the free queue)
    fresh = pool.allocate(3)         # or None when fewer than 3 blocks are free
    pool.cache(block, block_hash)    # a block became full
    pool.free(hit + fresh)           # back to the free queue, tail first
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = array("l", [0]) * num_blocks
        self._fresh = 0
        """Blocks from here on were never used: the head of the free queue, ahead of every freed block
        (kept as a count so a 4M-token cache costs no memory until used)."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Freed blocks, least recently freed first."""
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no request holds, cached or not: what `allocate` can hand out."""
        return self.num_blocks - self._fresh + len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def longest_hit(self, hashes: Sequence[bytes]) -> list[int]:
        blocks = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free queue (taking them leaves fewer blocks to allocate)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]  # a cached block was freed before, so it is not a fresh one
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        if count > self.num_free:
            return None
        blocks = []
        fresh = min(count, self.num_blocks - self._fresh)
        for block in range(self._fresh, self._fresh + fresh):
            self._refs[block] = 1
            blocks.append(block)
        self._fresh += fresh
        for _ in range(count - fresh):
            block, _ = self._free.popitem(last=False)
            evicted = self._hash_of.pop(block, None)
            if evicted is not None:
                del self._cached[evicted]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a block that became full. When another block already holds this hash (two requests
        computed the same prefix at once), the first one stays the cached one."""
        if block not in self._hash_of and block_hash not in self._cached:
            self._hash_of[block] = block_hash
            self._cached[block_hash] = block

    def free(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
