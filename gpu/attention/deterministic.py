"""Batch-invariant attention for deterministic mode (any device; tested on CPU).

NOTE: invariant 7. A query token's output is computed by the same fixed-shape operations
in the same order whatever else is in the batch, however its prompt was chunked, and
whether its prefix's KV came from the cache:
- keys are cut into blocks of KEY_BLOCK tokens on *absolute* positions and merged in
  block order with an online softmax; a fully masked block is an exact no-op (its
  weights are exactly 0 and the rescale factor exactly 1), so padding to the batch's
  longest request changes nothing;
- query rows go through fixed [QUERY_TILE * group, head_dim] x [head_dim, KEY_BLOCK]
  batched GEMMs, whose rows do not depend on their neighbours nor on the batch count
  (gpu/batch_invariant.py: torch's on CPU, a fixed-tile Triton GEMM on CUDA);
- the softmax denominator comes out of the same GEMM as the values (V gets a ones
  column), so no reduction over keys depends on the block count.
Because blocks sit on absolute positions, a prefix hit of any page-aligned length needs
no rounding: the chunk that follows reads the same blocks a cold run reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from cache.kv_pool import KVPool
from gpu.attention.base import AttentionBackend
from gpu.batch_invariant import bmm
from gpu.graphs.static_buffers import BufferSpec
from gpu.upload import to_device
from kernel.registry import register

QUERY_TILE = 8
KEY_BLOCK = 64
_NEG = -1.0e30  # finite start for the running max: exp(_NEG - m) is exactly 0


@register("attention", "deterministic")
class DeterministicAttention(AttentionBackend):
    """Static shapes: tiles are rows (a bucket of T tokens and R requests needs at most
    ceil(T / QUERY_TILE) + R of them), key blocks cover the whole request table, so a
    bucket's metadata has fixed shapes; padding tiles read page 0 only (`tile_tok` -1:
    the zero query row, `key_slots` 0, every key visible) and padding tokens write slot 0
    and take their output from row 0."""

    supports_static = True

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, cpu_kernels: bool = False) -> None:
        super().__init__(pool, req_to_token, cpu_kernels)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self._tile_tok = torch.empty(0, dtype=torch.int64)  # [tiles, QUERY_TILE] flat token, -1 pad
        self._key_slots = torch.empty(0, dtype=torch.int64)  # [tiles, blocks, KEY_BLOCK]
        self._mask = torch.empty(0, dtype=torch.bool)  # [tiles, blocks, QUERY_TILE, KEY_BLOCK]
        self._tok_src = torch.empty(0, dtype=torch.int64)  # [T] row of each token in the tiles' output
        self.max_blocks = -(-req_to_token.shape[1] // KEY_BLOCK)

    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        self._bind(self._metadata(rows, prefix_lens, extend_lens, None))

    def static_rows(self, tokens: int, requests: int) -> dict[str, int]:
        return {"tiles": -(-tokens // QUERY_TILE) + requests}

    def static_specs(self) -> dict[str, BufferSpec]:
        q, k, b = QUERY_TILE, KEY_BLOCK, self.max_blocks
        return {
            "out_cache_loc": BufferSpec("tokens", (), torch.int64, 0),  # slot 0 of the reserved page
            "tok_src": BufferSpec("tokens", (), torch.int64, 0),
            "tile_tok": BufferSpec("tiles", (q,), torch.int64, -1),  # the zero query row
            "key_slots": BufferSpec("tiles", (b, k), torch.int64, 0),  # page 0
            "mask": BufferSpec("tiles", (b, q, k), torch.bool, True),  # finite: all of page 0 visible
        }

    def static_metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        return self._metadata(rows, prefix_lens, extend_lens, self.max_blocks)

    def bind_static(self, views: Mapping[str, torch.Tensor]) -> None:
        self._bind(views)

    def _bind(self, meta: Mapping[str, torch.Tensor]) -> None:
        self.out_cache_loc, self._tok_src = meta["out_cache_loc"], meta["tok_src"]
        self._tile_tok, self._key_slots, self._mask = meta["tile_tok"], meta["key_slots"], meta["mask"]

    def _metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int], blocks: int | None
    ) -> dict[str, torch.Tensor]:
        """blocks: key blocks to cover (None: just enough for the step's longest request)."""
        device = self.req_to_token.device
        table = self.req_to_token
        locs: list[torch.Tensor] = []
        tile_tok: list[list[int]] = []
        tile_pos: list[list[int]] = []
        tile_row: list[int] = []
        tok_src: list[int] = []
        tok = 0
        for row, prefix, num in zip(rows, prefix_lens, extend_lens):
            locs.append(table[row, prefix : prefix + num])
            for start in range(0, num, QUERY_TILE):
                n = min(QUERY_TILE, num - start)
                pad = QUERY_TILE - n
                tok_src.extend(range(len(tile_tok) * QUERY_TILE, len(tile_tok) * QUERY_TILE + n))
                tile_tok.append(list(range(tok + start, tok + start + n)) + [-1] * pad)
                tile_pos.append(list(range(prefix + start, prefix + start + n)) + [0] * pad)
                tile_row.append(row)
            tok += num
        pos = to_device(tile_pos, torch.int64, device)  # [tiles, QUERY_TILE]
        # From the host lists: `pos.max()` as a Python int would wait for the device.
        blocks = blocks or -(-(max(max(p) for p in tile_pos) + 1) // KEY_BLOCK)
        key_pos = torch.arange(blocks * KEY_BLOCK, device=device).view(blocks, KEY_BLOCK)
        visible = key_pos[None, :, None, :] <= pos[:, None, :, None]  # [tiles, blocks, Q, K]
        slots = table[to_device(tile_row, torch.int64, device), : blocks * KEY_BLOCK]
        slots = F.pad(slots, (0, blocks * KEY_BLOCK - slots.shape[1]))  # past the table: page 0
        readable = (key_pos.view(1, -1) <= pos.max(dim=1).values[:, None]).view(slots.shape)
        # Past a tile's last position the table is stale: read the zero page there.
        return {
            "out_cache_loc": torch.cat(locs),
            "tok_src": to_device(tok_src, torch.int64, device),
            "tile_tok": to_device(tile_tok, torch.int64, device),
            "key_slots": torch.where(readable, slots, 0).view(-1, blocks, KEY_BLOCK),
            "mask": visible,
        }

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.out_cache_loc, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        tiles = self._tile_tok.shape[0]
        _, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[1]
        group = num_heads // num_kv
        rows = QUERY_TILE * group
        # [tiles * kv_heads, QUERY_TILE * group, D]: each kv head's query rows, token-major.
        qt = F.pad(q, (0, 0, 0, 0, 0, 1))[self._tile_tok]  # index -1 hits the zero pad row
        qt = qt.view(tiles, QUERY_TILE, num_kv, group, head_dim).permute(0, 2, 1, 3, 4)
        # Scores, softmax and the running sums in float32 whatever the model dtype: in bf16
        # the denominator column (a sum over every key) would keep only 8 bits.
        qt = qt.reshape(tiles * num_kv, rows, head_dim).float() * (head_dim**-0.5)
        m = torch.full((tiles * num_kv, rows), _NEG, dtype=torch.float32, device=q.device)
        acc = torch.zeros((tiles * num_kv, rows, head_dim + 1), dtype=torch.float32, device=q.device)
        for j in range(self._key_slots.shape[1]):
            slots = self._key_slots[:, j].reshape(-1)
            kb = k_cache.index_select(0, slots).view(tiles, KEY_BLOCK, num_kv, head_dim)
            vb = v_cache.index_select(0, slots).view(tiles, KEY_BLOCK, num_kv, head_dim)
            kb = kb.permute(0, 2, 3, 1).reshape(tiles * num_kv, head_dim, KEY_BLOCK).float()
            vb = F.pad(vb.float(), (0, 1), value=1.0).permute(0, 2, 1, 3).reshape(tiles * num_kv, KEY_BLOCK, head_dim + 1)
            s = bmm(qt, kb).view(tiles, num_kv, QUERY_TILE, group, KEY_BLOCK)
            s = s.masked_fill(~self._mask[:, j][:, None, :, None, :], float("-inf"))
            s = s.view(tiles * num_kv, rows, KEY_BLOCK)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            acc = acc * torch.exp(m - m_new)[..., None] + bmm(p, vb)
            m = m_new
        o = (acc[..., :head_dim] / acc[..., head_dim:]).to(q.dtype)
        o = o.view(tiles, num_kv, QUERY_TILE, group, head_dim).permute(0, 2, 1, 3, 4)
        o = o.reshape(tiles * QUERY_TILE, num_heads, head_dim)
        # Each token's row of the tiles' output (a gather: static shapes, no boolean index).
        return o.index_select(0, self._tok_src)
