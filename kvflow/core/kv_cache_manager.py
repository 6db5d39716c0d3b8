"""Per-request block tables on top of the BlockPool, and the prefix-cache lookups.

The only place that decides which KV blocks a request holds. The model runner just follows the
blocks handed to it in SchedulerOutput (a new request's whole table, then the blocks appended),
the simulator the tables in SchedulerOutput.block_ids.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.block_pool import BlockPool, KVCacheBlock
from kvflow.core.request import Request

# Parent "hash" of a request's first block; any fixed int works, a fixed one keeps runs repeatable.
ROOT_HASH = 0x6B76666C6F77


def hash_block_tokens(parent: int, tokens: Sequence[int]) -> int:
    # Python's tuple hash is deterministic for ints (PYTHONHASHSEED only salts str/bytes) and
    # 64-bit; the key chains on the parent so equal blocks after different prefixes differ.
    return hash((parent, tuple(tokens)))


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, max_model_len: int,
                 enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self._blocks = self.block_pool.blocks
        # request_id -> block ids. Copy-on-write: a list handed out is never mutated, so an old
        # SchedulerOutput keeps the table it was given.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # request_id -> how many of its leading blocks are in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # request_id -> the block ids allocate_slots appended to its table since the scheduler
        # last took them (each step): what SchedulerOutput sends a runner as new_block_ids.
        self.new_block_ids: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_to_block_ids.get(request_id, ()))

    def free_block_ids(self) -> list[int]:
        return self.block_pool.free_queue.block_ids()

    def block_hash(self, block_id: int) -> int | None:
        return self._blocks[block_id].block_hash

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def _hash_up_to(self, request: Request, num_blocks: int) -> list[int]:
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            toks, bs = request.all_token_ids, self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, toks[i * bs:(i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix in whole blocks, leaving at least one token to compute."""
        # Prompt logprobs need every prompt position's logits: such a request computes it all.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        hashes = self._hash_up_to(request, max_blocks)
        lookup, hits = self.block_pool.lookup, []
        for i in range(max_blocks):
            b = lookup(hashes[i])
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def _cache_blocks(self, request: Request, ids: list[int], num_full: int) -> None:
        rid = request.request_id
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._hash_up_to(request, num_full)
        cache, blocks = self.block_pool.cache_block, self._blocks
        for i in range(start, num_full):
            cache(blocks[ids[i]], hashes[i])
        self.num_cached_block[rid] = num_full

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] = (), watermark_blocks: int = 0,
                       full_sequence: bool = False) -> list[int] | None:
        """Give `request` slots for `num_new_tokens` more tokens (after any prefix hit).

        Returns the request's whole block table, or None with nothing changed when the pool
        cannot supply the blocks (plus `watermark_blocks` kept in reserve). `full_sequence`
        additionally requires room for the whole current sequence (admission control).
        """
        bs = self.block_size
        rid = request.request_id
        ids = self.req_to_block_ids.get(rid)
        num_have = len(ids) if ids is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_need = num_computed + num_new_tokens
        if num_need > self.max_model_len:
            num_need = self.max_model_len
        num_hits = len(new_computed_blocks)
        if not num_hits and num_need <= num_have * bs and not full_sequence:
            # Fast path (every decode step but one in block_size): no new block needed, and a
            # block to cache only if this step's tokens cross a block boundary.
            if self.enable_caching and num_need // bs > num_computed // bs:
                self._cache_blocks(request, ids, min(num_need, len(request.all_token_ids)) // bs)
            return ids
        # Hits sitting in the free queue stop being free once taken: count them as allocations.
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if num_hits else 0
        free = self.block_pool.num_free_blocks - watermark_blocks
        if full_sequence:
            full_tokens = min(len(request.all_token_ids), self.max_model_len)
            if -(-full_tokens // bs) - num_hits - num_have + evictable > free:
                return None
        num_new_blocks = -(-num_need // bs) - num_hits - num_have
        if max(num_new_blocks, 0) + evictable > free:
            return None
        if num_hits:
            self.block_pool.touch(new_computed_blocks)
        if num_hits or num_new_blocks > 0:
            new_ids = [b.block_id for b in new_computed_blocks]
            if num_new_blocks > 0:
                new_ids += [b.block_id for b in self.block_pool.get_new_blocks(num_new_blocks)]
            ids = new_ids if ids is None else ids + new_ids
            self.req_to_block_ids[rid] = ids
            self.new_block_ids[rid] = new_ids
        assert ids is not None, "a new request always needs at least one block"
        if rid not in self.num_cached_block:
            self.num_cached_block[rid] = num_hits
        if self.enable_caching:
            self._cache_blocks(request, ids, min(num_need, len(request.all_token_ids)) // bs)
        return ids

    def cache_known_blocks(self, request: Request) -> None:
        """Async scheduling: a block left uncached when it was scheduled, because a token of it
        was still in flight, is cached once that token is known (its KV is written by a step
        that runs before any step that could hit it)."""
        ids = self.req_to_block_ids.get(request.request_id)
        if self.enable_caching and ids:
            num_known = min(request.num_computed_tokens, len(request.all_token_ids))
            self._cache_blocks(request, ids, num_known // self.block_size)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so the LRU evicts tails first."""
        rid = request.request_id
        self.num_cached_block.pop(rid, None)
        self.new_block_ids.pop(rid, None)
        ids = self.req_to_block_ids.pop(rid, None)
        if ids:
            blocks = self._blocks
            self.block_pool.free_blocks([blocks[i] for i in reversed(ids)])

    def uncache_uncomputed(self, request: Request) -> None:
        """Drop hashes cached this step for tokens that will now never be computed.

        Only needed when a request already scheduled in this step is preempted (priority policy):
        its blocks were cached at scheduling time, before their KV was written.
        """
        ids = self.req_to_block_ids.get(request.request_id, ())
        start = request.num_computed_tokens // self.block_size
        for i in range(start, len(ids)):
            self.block_pool.uncache(self._blocks[ids[i]])

    def take_new_block_ids(self) -> dict[str, list[int]]:
        new, self.new_block_ids = self.new_block_ids, {}
        return new

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
