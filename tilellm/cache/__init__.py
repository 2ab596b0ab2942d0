"""Paged KV cache bookkeeping: the block pool, reference counts and prefix caching."""

from tilellm.cache.block_manager import BlockManager, PoolSnapshot

__all__ = ["BlockManager", "PoolSnapshot"]
