"""The paged KV cache's bookkeeping: a free list of fixed-size blocks and per-sequence block tables."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out KV blocks of block_size tokens; a sequence's block table grows as its tokens are computed."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens positions."""
        return -(-num_tokens // self.block_size)

    def ensure(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow block_table to hold num_tokens positions; all or nothing: False (and no change) if too few free."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > len(self._free):
            return False
        block_table.extend(self._free.popleft() for _ in range(max(0, need)))
        return True

    def free(self, block_table: list[int]) -> None:
        """Return a sequence's blocks to the pool and empty its table."""
        self._free.extend(block_table)
        block_table.clear()
