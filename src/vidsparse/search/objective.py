"""The PSA search objective: how far each candidate's stripe attention is from dense attention.

For every (head, candidate) the objective compares the output of attention restricted to the
candidate's block mask with the dense output, over the real tokens of (a sample of) the query
blocks::

    rel_l2[h, c] = ||O_c[h] - O_dense[h]||_F / ||O_dense[h]||_F
    cosine[h, c] = <O_c[h], O_dense[h]> / (||O_c[h]|| ||O_dense[h]||)      (flattened outputs)

Nothing of size ``S x S`` is ever built: both outputs come from the block-sparse engine
(``block_sparse_attn``), the dense one with every key block listed. To evaluate ~100
candidates quickly, candidates become the engine's *head* dimension and the calibration heads
its *batch* dimension; q/k/v are broadcast with ``expand`` (no copies), and the lists of a
chunk of candidates (``[1, Cc, NQ, K]``, shared by every head) are built once and reused::

    q [B*H, S, D] --expand--> [B*H, Cc, S, D]     lists [1, Cc, NQ, K]  (candidate = engine head)
                                   |                         |
                                   +---- block_sparse_attn --+--> O [B*H, Cc, S, D]

Each query block's output depends only on its own key list, so the objective may evaluate a
uniform random subset of query blocks (``query_fraction``): the cost falls in proportion and
the loss estimate stays unbiased in expectation over the blocks.

PSA blocks are the grid's tiles. The engine's Triton kernels want power-of-two blocks, so a
tile of, e.g., 384 tokens is run as 3 engine blocks of 128: every list entry becomes 3 entries
and every query block 3 query blocks with the same list (``engine_block_size``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vidsparse.layout.grid import VideoGrid
from vidsparse.masks.block_sparse import refine_block_lists, refine_block_sizes
from vidsparse.masks.stripe import stripe_block_lists
from vidsparse.search.candidates import Candidate, CandidateSet
from vidsparse.utils.backend import resolve_backend
from vidsparse.utils.checks import softmax_scale

__all__ = [
    "LossStats",
    "StripeObjective",
    "stripe_losses",
    "engine_block_size",
    "choose_query_blocks",
]

# Default bound on the bytes of one chunk's engine output ([B*H, Cc, Sq, D]).
DEFAULT_CHUNK_BYTES = 2 << 30
# The PyTorch reference pads every list of a launch to the launch's busiest row, so on the CPU
# small chunks of similar candidates are several times faster than one big launch.
CPU_CHUNK = 8


@dataclass
class LossStats:
    """Sufficient statistics of the objective for one calibration sample (or a pool of them).

    ``err_sq[h, c] = ||O_c - O_dense||^2``, ``cand_sq[h, c] = ||O_c||^2``, ``ref_sq[h] =
    ||O_dense||^2`` (float64, summed over batch and the evaluated real tokens). Sums of
    statistics pool samples, so losses of a step bucket come out without recomputing anything.
    """

    err_sq: torch.Tensor  # float64 [H, C]
    cand_sq: torch.Tensor  # float64 [H, C]
    ref_sq: torch.Tensor  # float64 [H]

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            self.err_sq + other.err_sq, self.cand_sq + other.cand_sq, self.ref_sq + other.ref_sq
        )

    @property
    def rel_l2(self) -> torch.Tensor:
        """float64 ``[H, C]``; 0 where both outputs are zero, inf where only the reference is."""
        return relative_l2(self.err_sq, self.ref_sq)

    @property
    def cosine(self) -> torch.Tensor:
        """float64 ``[H, C]``, from the norms (``<a,b> = (|a|^2 + |b|^2 - |a-b|^2) / 2``)."""
        return cosine_from_norms(self.err_sq, self.cand_sq, self.ref_sq)


def relative_l2(err_sq: torch.Tensor, ref_sq: torch.Tensor) -> torch.Tensor:
    ref = ref_sq.unsqueeze(-1)
    rel = (err_sq / ref.clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
    zero_ref = ref == 0
    return torch.where(zero_ref & (err_sq == 0), 0.0, torch.where(zero_ref, math.inf, rel))


def cosine_from_norms(err_sq, cand_sq, ref_sq) -> torch.Tensor:
    ref = ref_sq.unsqueeze(-1)
    dot = 0.5 * (cand_sq + ref - err_sq)
    denom = (cand_sq * ref).sqrt()
    cos = dot / denom.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(denom > 0, cos.clamp(-1.0, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------
# geometry helpers
# ---------------------------------------------------------------------------------------------


def engine_block_size(tile_volume: int) -> int:
    """The engine block for PSA blocks of ``tile_volume`` tokens: the largest of 128, 64, 32,
    16 dividing it (Triton needs powers of two), else the tile itself (torch backend only)."""
    for b in (128, 64, 32, 16):
        if tile_volume % b == 0:
            return b
    return tile_volume


def choose_query_blocks(
    num_blocks: int, fraction: float = 1.0, *, seed: int = 0, device=None
) -> torch.Tensor:
    """A uniform random subset of ``max(1, round(fraction * num_blocks))`` query blocks,
    ascending int64; all blocks (no randomness) when ``fraction == 1``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"query_fraction must be a float, got {fraction!r}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"query_fraction must lie in (0, 1], got {fraction}")
    count = max(1, round(fraction * num_blocks))
    if count >= num_blocks:
        return torch.arange(num_blocks, device=device)
    # Random rather than evenly spaced: even spacing could alias with a periodic stripe.
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randperm(num_blocks, generator=gen)[:count]
    return picked.sort().values.to(device)


def _as_bhsd(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 3:
        return x.unsqueeze(0)
    if x.ndim != 4:
        raise ValueError(f"{name} must be [H, S, D] or [B, H, S, D], got shape {tuple(x.shape)}")
    return x


# ---------------------------------------------------------------------------------------------
# the objective
# ---------------------------------------------------------------------------------------------


class StripeObjective:
    """Losses of every candidate of a set, per head, for q/k/v of one grid.

    Build once per (grid, candidates); call once per calibration sample. The candidate lists
    and the query-block sample are made on the first call and reused (and the engine checks
    each list tensor only once).

    Args:
        grid: the video grid; its tile is the PSA block, so the block grid is ``grid.tiles``.
        candidates: a ``CandidateSet`` of that block grid, or candidates (kept as given).
        query_fraction: fraction of query blocks evaluated (uniform random subset, ``seed``).
        query_blocks: explicit query blocks instead (ints in ``[0, grid.num_tiles)``).
        candidate_chunk: candidates per engine launch; default: as many as fit
            ``max_chunk_bytes`` of output (at most ``CPU_CHUNK`` on the CPU).
        scale: softmax scale (default ``1/sqrt(D)``).
    """

    def __init__(
        self,
        grid: VideoGrid,
        candidates: CandidateSet | Sequence[Candidate],
        *,
        query_fraction: float = 1.0,
        query_blocks: Sequence[int] | torch.Tensor | None = None,
        seed: int = 0,
        candidate_chunk: int | None = None,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        scale: float | None = None,
    ):
        if not isinstance(grid, VideoGrid):
            raise TypeError(f"grid must be a VideoGrid, got {type(grid).__name__}")
        if not isinstance(candidates, CandidateSet):
            candidates = CandidateSet.build(candidates, grid.tiles, dedupe=False)
        if candidates.block_grid != grid.tiles:
            raise ValueError(
                f"candidates were built for block grid {candidates.block_grid}, but the grid's "
                f"tiles are {grid.tiles}"
            )
        if candidate_chunk is not None and (
            isinstance(candidate_chunk, bool)
            or not isinstance(candidate_chunk, int)
            or candidate_chunk < 1
        ):
            raise ValueError(f"candidate_chunk must be a positive int, got {candidate_chunk!r}")
        self.grid = grid
        self.candidates = candidates
        self.scale = scale
        self.candidate_chunk = candidate_chunk
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.engine_block = engine_block_size(grid.tile_volume)
        self.ratio = grid.tile_volume // self.engine_block
        self.query_blocks = self._check_query_blocks(query_blocks, query_fraction, seed)
        # Similar candidates in one chunk keep its lists narrow (K is the chunk's busiest row).
        self._order = torch.argsort(candidates.sparsity, descending=True, stable=True)
        self._lists: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._aux: dict[torch.device, tuple] = {}

    def _check_query_blocks(self, query_blocks, fraction, seed) -> torch.Tensor:
        n = self.grid.num_tiles
        if query_blocks is None:
            return choose_query_blocks(n, fraction, seed=seed)
        qb = torch.as_tensor(query_blocks).long().flatten().unique()  # sorted, distinct
        if qb.numel() == 0 or int(qb.min()) < 0 or int(qb.max()) >= n:
            raise ValueError(f"query_blocks must be non-empty ints in [0, {n}), got {qb.tolist()}")
        return qb

    @property
    def num_candidates(self) -> int:
        return len(self.candidates)

    # ---- cached per device -------------------------------------------------------------

    def _device_aux(self, device: torch.device):
        """(query blocks, real-row mask of the sampled rows, engine key-block sizes, dense
        lists) on ``device``."""
        if device not in self._aux:
            grid, eb = self.grid, self.engine_block
            qb = self.query_blocks.to(device)
            real = grid.real_token_mask(device).view(grid.num_tiles, grid.tile_volume)[qb]
            sizes = refine_block_sizes(grid.tile_sizes_on(device), self.ratio, eb)
            nq, nk = qb.numel() * self.ratio, sizes.numel()
            # Dense: every query block lists every key block, ascending (as the dense candidate).
            dense_idx = torch.arange(nk, device=device, dtype=torch.int32).expand(1, 1, nq, nk)
            dense_cnt = torch.full((1, 1, nq), nk, device=device, dtype=torch.int32)
            self._aux[device] = (qb, real.reshape(-1), sizes, dense_idx.contiguous(), dense_cnt)
        return self._aux[device]

    def _chunk_lists(self, chunk: torch.Tensor, device: torch.device):
        key = (tuple(chunk.tolist()), device)
        if key not in self._lists:
            specs = tuple(self.candidates.block_specs()[i] for i in chunk.tolist())
            idx, cnt = stripe_block_lists(specs, self.grid.tiles, "block", device=device)
            qb = self._device_aux(device)[0]
            idx, cnt = idx[:, :, qb], cnt[:, :, qb]  # only the sampled query blocks
            # Trim to the sampled rows' busiest count; keeps the lists (and memory) minimal.
            k = max(int(cnt.max()), 1)
            self._lists[key] = refine_block_lists(idx[..., :k], cnt, self.ratio)
        return self._lists[key]

    def _chunks(self, rows: int, seq: int, dim: int, elem: int, device) -> list[torch.Tensor]:
        c = self.num_candidates
        size = self.candidate_chunk
        if size is None:
            per_candidate = rows * seq * dim * elem
            size = max(1, min(c, self.max_chunk_bytes // max(per_candidate, 1)))
            if device.type == "cpu":
                size = min(size, CPU_CHUNK)
        return [self._order[s : s + size] for s in range(0, c, size)]

    # ---- evaluation --------------------------------------------------------------------

    def _prepare(self, x: torch.Tensor, name: str, tiled: bool) -> torch.Tensor:
        """[H,S,D] or [B,H,S,D], natural or tile order -> tile order [B*H, padded_len, D]."""
        x = _as_bhsd(name, x)
        expected = self.grid.padded_len if tiled else self.grid.num_tokens
        if x.shape[2] != expected:
            what = "padded_len (tiled=True)" if tiled else "num_tokens (natural order)"
            raise ValueError(
                f"{name} must have {what} = {expected} tokens for {self.grid!r}, got shape "
                f"{tuple(x.shape)}"
            )
        if not tiled:
            x = self.grid.tile(x, dim=2)
        return x.reshape(-1, x.shape[2], x.shape[3])

    @torch.no_grad()
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, tiled: bool = False
    ) -> LossStats:
        """Loss statistics of every candidate for q/k/v ``[H, S, D]`` or ``[B, H, S, D]``
        (natural order, or tile order with ``tiled=True``). Summed over the batch."""
        # the engine picks its backend
        from vidsparse.ops.block_sparse_attn import block_sparse_attn, block_sparse_attn_unchecked

        shapes = {tuple(_as_bhsd(n, x).shape) for n, x in (("q", q), ("k", k), ("v", v))}
        if len(shapes) != 1:
            raise ValueError(f"q, k, v must have the same shape, got {sorted(shapes)}")
        b, h = _as_bhsd("q", q).shape[:2]
        qt, kt, vt = (self._prepare(x, n, tiled) for n, x in (("q", q), ("k", k), ("v", v)))
        device = qt.device
        qb, real, sizes, dense_idx, dense_cnt = self._device_aux(device)
        n, vol, d = self.grid.num_tiles, self.grid.tile_volume, qt.shape[-1]
        q_sel = qt.reshape(b * h, n, vol, d)[:, qb].reshape(b * h, -1, d)  # [BH, Sq, D]
        q_sel = q_sel.unsqueeze(1)  # [BH, 1, Sq, D]
        kt, vt = kt.unsqueeze(1), vt.unsqueeze(1)  # [BH, 1, Skv, D]
        pad_rows = ~real.view(1, 1, -1, 1)

        eb = self.engine_block
        # A tile with no power-of-two engine block runs on the torch backend only; on the
        # Triton path the public entry refuses it (naming block_size) before any launch.
        internal = bool(eb & (eb - 1)) and resolve_backend(device) == "torch"
        scale = softmax_scale(self.scale, d)

        def attend(idx, cnt):
            c = idx.shape[1]
            # Candidates are engine heads; expand shares q/k/v memory across them. Key-block
            # sizes are always passed: besides masking padding, they keep the engine on its
            # generic-stride kernel, which accepts the zero strides of the expanded inputs.
            args = (q_sel.expand(-1, c, -1, -1), kt.expand(-1, c, -1, -1),
                    vt.expand(-1, c, -1, -1), idx, cnt)  # fmt: skip
            if internal:
                # The public entry takes powers of two only (on every backend); the torch
                # reference takes any block, through the internal entry (these lists are the
                # objective's own, valid by construction).
                o, _ = block_sparse_attn_unchecked(
                    *args, block_q=eb, block_kv=eb, kv_block_sizes=sizes, scale=scale
                )
            else:
                o = block_sparse_attn(*args, block_size=eb, kv_block_sizes=sizes, scale=scale)
            return o.masked_fill_(pad_rows, 0)  # padding query rows do not count

        ref = attend(dense_idx, dense_cnt)  # [BH, 1, Sq, D]
        ref_sq = _sq_norm(ref)[:, 0]  # [BH]
        err_sq = torch.empty(b * h, self.num_candidates, dtype=torch.float64, device=device)
        cand_sq = torch.empty_like(err_sq)
        elem = qt.element_size()
        for chunk in self._chunks(b * h, q_sel.shape[2], d, elem, device):
            o = attend(*self._chunk_lists(chunk, device))  # [BH, Cc, Sq, D]
            cols = chunk.to(device)
            cand_sq[:, cols] = _sq_norm(o)
            err_sq[:, cols] = _sq_norm(o.sub_(ref))  # in place: one output-sized buffer
            del o

        def per_head(x):  # [B*H, ...] -> [H, ...], summed over batch
            return x.view(b, h, *x.shape[1:]).sum(0).cpu()

        return LossStats(per_head(err_sq), per_head(cand_sq), per_head(ref_sq))


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """Squared Frobenius norm over the last two dims, accumulated in fp32, returned in fp64."""
    return torch.linalg.vector_norm(x, dim=(-2, -1), dtype=torch.float32).double().square()


def stripe_losses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grid: VideoGrid,
    candidates: CandidateSet | Sequence[Candidate],
    *,
    tiled: bool = False,
    **options,
) -> LossStats:
    """One-shot ``StripeObjective(grid, candidates, **options)(q, k, v, tiled=tiled)``.

    ``.rel_l2`` and ``.cosine`` of the result are ``[H, C]``.
    """
    return StripeObjective(grid, candidates, **options)(q, k, v, tiled=tiled)
