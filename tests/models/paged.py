"""A minimal paged-KV bookkeeper for model tests: block tables, slots and per-step metadata.

It plays the runner's part: each request gets random physical blocks, and `step(...)` packs the
new tokens of several requests into `(input_ids, positions, AttentionMetadata)`.
"""

from __future__ import annotations

import torch

from tilellm.attention import AttentionMetadata, BatchKind


class PagedKV:
    def __init__(self, model, num_requests: int, max_len: int, block_size: int = 4, seed: int = 0):
        attn = model.attention_layers()
        a0 = attn[0]
        self.block_size = block_size
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_requests * blocks_per_seq + 3  # a few never used
        gen = torch.Generator().manual_seed(seed)
        # random, disjoint physical blocks per request
        perm = torch.randperm(num_blocks, generator=gen)[: num_requests * blocks_per_seq]
        self.block_table = perm.view(num_requests, blocks_per_seq).to(torch.int32)
        dtype = next(model.parameters()).dtype
        for layer in attn:
            shape = (num_blocks, block_size, a0.num_kv_heads, a0.head_dim)
            if hasattr(layer, "kv_lora_rank"):  # MLA: one cache of latent rows
                layer.bind_kv_cache(torch.zeros(shape, dtype=dtype))
                if hasattr(layer, "bind_index_cache"):  # DeepSeek-V3.2: and the indexer keys
                    index_shape = (num_blocks, block_size, 1, layer.index_head_dim)
                    layer.bind_index_cache(torch.zeros(index_shape, dtype=dtype))
            else:
                layer.bind_kv_cache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        self.cached = [0] * num_requests  # tokens already in the cache, per request

    def slot(self, req: int, pos: int) -> int:
        return int(self.block_table[req, pos // self.block_size]) * self.block_size + pos % self.block_size

    def step(self, kind: BatchKind, chunks: list[tuple[int, list[int]]]):
        """chunks: (request, its new token ids) in batch order. Returns (input_ids, positions, meta)
        and advances each request's cached length."""
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for req, tokens in chunks:
            start = self.cached[req]
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [self.slot(req, p) for p in range(start, start + len(tokens))]
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(start + len(tokens))
            self.cached[req] += len(tokens)
        q_lens = [len(t) for _, t in chunks]
        meta = AttentionMetadata(
            kind=kind,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            block_table=self.block_table[[req for req, _ in chunks]].contiguous(),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta
