"""The pool of KV-cache blocks: an O(1) free queue (LRU eviction order) and the prefix-cache map.

A block is either held (ref_cnt > 0) or in the free queue (ref_cnt == 0), never both. A free
block may still carry its hash: it is an eviction candidate that a prefix-cache hit can revive.
"""
from __future__ import annotations


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves, between two sentinels."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self.tail.prev_free = self.tail, prev
        self.num_free = len(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free:       # a real check: under python -O an assert would corrupt the list
            raise RuntimeError(f"asked for {n} blocks, the free queue holds {self.num_free}")
        out = []
        b = self.head.next_free
        for _ in range(n):
            out.append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        self.head.next_free, b.prev_free = b, self.head
        self.num_free -= n
        return out

    def remove(self, b: KVCacheBlock) -> None:
        assert b.prev_free is not None, f"block {b.block_id} is not in the free queue"
        b.prev_free.next_free, b.next_free.prev_free = b.next_free, b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: KVCacheBlock) -> None:
        self._insert_after(self.tail.prev_free, b)

    def appendleft(self, b: KVCacheBlock) -> None:
        self._insert_after(self.head, b)

    def _insert_after(self, prev: KVCacheBlock, b: KVCacheBlock) -> None:
        if b.prev_free is not None or b.next_free is not None:
            raise RuntimeError(f"block {b.block_id} is already in the free queue")
        nxt = prev.next_free
        prev.next_free, b.prev_free, b.next_free, nxt.prev_free = b, prev, nxt, b
        self.num_free += 1

    def block_ids(self) -> list[int]:
        out, b = [], self.head.next_free
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # hash -> block, or hash -> {block_id: block} when several blocks hold the same content
        # (two requests that computed the same block without hitting each other).
        self.cached: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def lookup(self, block_hash: int) -> KVCacheBlock | None:
        hit = self.cached.get(block_hash)
        if hit is None or isinstance(hit, KVCacheBlock):
            return hit
        return next(iter(hit.values()))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head; a cached block popped here loses its hash (eviction)."""
        blocks = self.free_queue.popleft_n(n)
        for b in blocks:
            if b.block_hash is not None:
                self._uncache(b)
            b.ref_cnt = 1
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving those that sat in the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """Drop one reference on each block. Those reaching 0 join the free queue: hashed ones at
        the tail in the given order (LRU), unhashed ones at the head, since no prefix-cache hit
        can ever revive them and they should be reused before any cached block (as vLLM 0.33)."""
        fq = self.free_queue
        for b in ordered:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"block {b.block_id} freed more often than allocated")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (fq.append if b.block_hash is not None else fq.appendleft)(b)

    def cache_block(self, b: KVCacheBlock, block_hash: int) -> None:
        assert b.block_hash is None, f"block {b.block_id} is already cached"
        b.block_hash = block_hash
        cur = self.cached.get(block_hash)
        if cur is None:
            self.cached[block_hash] = b
        elif isinstance(cur, KVCacheBlock):
            self.cached[block_hash] = {cur.block_id: cur, b.block_id: b}
        else:
            cur[b.block_id] = b

    def _uncache(self, b: KVCacheBlock) -> None:
        h = b.block_hash
        cur = self.cached[h]
        if isinstance(cur, KVCacheBlock):
            del self.cached[h]
        else:
            del cur[b.block_id]
            if len(cur) == 1:
                self.cached[h] = next(iter(cur.values()))
        b.block_hash = None

    def uncache(self, b: KVCacheBlock) -> None:
        if b.block_hash is not None:
            self._uncache(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        return True

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
