"""The block-sparse index format read by ``block_sparse_attn``, and helpers to build and check it.

A block map says which key blocks each query block attends to. Kernels do not read the dense
map (it is ``NQ x NK`` per head, hundreds of MB at 720p); they read per-row lists that are only
as wide as the busiest row::

    block map [NQ=4, NK=5]         kv_indices [NQ, K=3]     kv_counts [NQ]
         k0 k1 k2 k3 k4
    q0 [  1  0  1  0  0 ]          [ 0  2  * ]              2
    q1 [  0  0  0  0  0 ]   --->   [ *  *  * ]              0      (empty row: o = 0)
    q2 [  1  1  0  0  1 ]          [ 0  1  4 ]              3
    q3 [  0  0  0  1  0 ]          [ 3  *  * ]              1

``*`` entries lie past the row's count and are never read (the builders here write 0 there).
Shapes carry leading ``[Bi, H]`` dims, ``Bi`` being the batch size or 1 (broadcast over batch):

- ``kv_indices`` int32 ``[Bi, H, NQ, K]``: distinct key blocks in ``[0, NK)`` per row.
- ``kv_counts``  int32 ``[Bi, H, NQ]``: ``0 <= count <= K``.

Backward passes need the transpose (for each key block, the query blocks reading it), kept in
CSR form so that its size stays ``O(NQ * K)``::

    q_offsets [NK + 1] = [0, 2, 3, 4, 5, 6]
    q_indices [NQ * K] = [0 2 | 2 | 0 | 3 | 2 | 0 ...]      key block j reads
                          k0    k1  k2  k3  k4  (unused)    q_indices[q_offsets[j]:q_offsets[j+1]]

All functions are vectorised torch ops (no loops over rows) and run on CPU or GPU tensors.
"""

from __future__ import annotations

import torch

from vidsparse.utils.checks import check_non_negative_int, check_positive_int, check_tensor

__all__ = [
    "validate_block_lists",
    "lists_from_dense",
    "dense_from_lists",
    "transpose_block_lists",
    "refine_block_lists",
    "refine_block_sizes",
    "random_block_lists",
    "block_density",
]

_INDEX_DTYPES = (torch.int32,)

# lists_from_dense works on chunks of rows of about this many map elements, so that its int64
# temporaries (a few per attended pair) stay near 100 MB even for dense maps.
_DENSE_CHUNK_ELEMS = 1 << 22


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _device_matches(actual: torch.device, expected: torch.device) -> bool:
    # "cuda" (no index) matches any CUDA device; "cuda:1" only itself.
    if actual.type != expected.type:
        return False
    return expected.index is None or actual.index is None or actual.index == expected.index


def _first_position(bad: torch.Tensor) -> tuple[int, ...]:
    """Coordinates of the first True element of ``bad`` (which is known to have one)."""
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def _valid_slots(kv_counts: torch.Tensor, k: int) -> torch.Tensor:
    """bool [Bi, H, NQ, K]: True for the entries of each row that the kernels read."""
    slots = torch.arange(k, device=kv_counts.device)  # [K]
    return slots < kv_counts.unsqueeze(-1)


def _check_structure(kv_indices, kv_counts) -> tuple[int, int, int, int]:
    check_tensor("kv_indices", kv_indices, ndim=4, dtypes=_INDEX_DTYPES)
    check_tensor("kv_counts", kv_counts, ndim=3, dtypes=_INDEX_DTYPES)
    bi, h, nq, k = kv_indices.shape
    if tuple(kv_counts.shape) != (bi, h, nq):
        raise ValueError(
            f"kv_counts must have shape {(bi, h, nq)} (the first three dims of kv_indices "
            f"{tuple(kv_indices.shape)}), got {tuple(kv_counts.shape)}"
        )
    if kv_counts.device != kv_indices.device:
        raise ValueError(
            f"kv_counts is on {kv_counts.device} but kv_indices is on {kv_indices.device}; "
            "they must share a device"
        )
    return bi, h, nq, k


def _check_values(kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_kv_blocks: int) -> None:
    """Counts in [0, K]; the read entries in [0, NK) and distinct per row. Syncs with the GPU."""
    k = kv_indices.shape[-1]

    bad = (kv_counts < 0) | (kv_counts > k)  # [Bi, H, NQ]
    if bool(bad.any()):
        pos = _first_position(bad)
        raise ValueError(
            f"kv_counts must lie in [0, K={k}] (K = kv_indices.shape[-1]); "
            f"kv_counts{list(pos)} = {int(kv_counts[pos])}"
        )

    valid = _valid_slots(kv_counts, k)  # [Bi, H, NQ, K]
    idx = kv_indices.long()
    bad = valid & ((idx < 0) | (idx >= num_kv_blocks))
    if bool(bad.any()):
        pos = _first_position(bad)
        raise ValueError(
            f"kv_indices must lie in [0, num_kv_blocks={num_kv_blocks}) in the first "
            f"kv_counts[b, h, i] entries of each row; kv_indices{list(pos)} = {int(idx[pos])}"
        )

    if k < 2:
        return
    # Unread slots get distinct values >= NK so that they collide with nothing; a duplicate
    # then shows up as two equal neighbours after sorting each row.
    slots = torch.arange(k, device=idx.device)
    filled = torch.where(valid, idx, num_kv_blocks + slots)  # [Bi, H, NQ, K]
    srt = filled.sort(dim=-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(dim=-1)  # [Bi, H, NQ]
    if bool(dup.any()):
        row = _first_position(dup)
        row_vals = srt[row]
        value = int(row_vals[1:][row_vals[1:] == row_vals[:-1]][0])
        count = int(kv_counts[row])
        where = (kv_indices[row][:count] == value).nonzero().flatten().tolist()
        raise ValueError(
            f"kv_indices must hold distinct key blocks within each row; row "
            f"kv_indices{list(row)} (kv_counts = {count}) holds block {value} at positions {where}"
        )


def _check_block_grid(batch, heads, num_q_blocks, num_kv_blocks, *, allow_empty=False) -> None:
    check = check_non_negative_int if allow_empty else check_positive_int
    for name, value in (
        ("batch", batch),
        ("heads", heads),
        ("num_q_blocks", num_q_blocks),
        ("num_kv_blocks", num_kv_blocks),
    ):
        check(name, value)


def validate_block_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    batch: int,
    heads: int,
    num_q_blocks: int,
    num_kv_blocks: int,
    device: torch.device | str,
    check_values: bool = True,
) -> None:
    """Check block lists against the problem they will be used for.

    Always checked (no GPU sync): int32 dtypes (``TypeError``), ``kv_indices`` of shape
    ``[Bi, heads, num_q_blocks, K]`` with ``Bi`` in ``{1, batch}``, ``kv_counts`` of shape
    ``[Bi, heads, num_q_blocks]``, both on ``device`` (``ValueError``).

    With ``check_values`` (one GPU sync; switch off in hot loops once the lists are trusted):
    every count in ``[0, K]``, and the first ``count`` entries of each row in
    ``[0, num_kv_blocks)`` and distinct. Entries past the count are not looked at.
    Values are not checked on the ``meta`` device. Sizes of 0 are legal (an empty problem;
    with ``num_kv_blocks = 0`` every count must be 0).
    """
    _check_block_grid(batch, heads, num_q_blocks, num_kv_blocks, allow_empty=True)
    bi, h, nq, _ = _check_structure(kv_indices, kv_counts)
    if bi not in (1, batch):
        raise ValueError(
            f"kv_indices must have batch dim 1 or batch={batch}, got shape "
            f"{tuple(kv_indices.shape)}"
        )
    if h != heads:
        raise ValueError(
            f"kv_indices must have heads={heads} in dim 1, got shape {tuple(kv_indices.shape)}"
        )
    if nq != num_q_blocks:
        raise ValueError(
            f"kv_indices must have num_q_blocks={num_q_blocks} in dim 2, got shape "
            f"{tuple(kv_indices.shape)}"
        )
    expected = torch.device(device)
    for name, t in (("kv_indices", kv_indices), ("kv_counts", kv_counts)):
        if not _device_matches(t.device, expected):
            raise ValueError(f"{name} must be on {expected} (where q lives), got {t.device}")
    if check_values and kv_indices.device.type != "meta":
        _check_values(kv_indices, kv_counts, num_kv_blocks)


# ---------------------------------------------------------------------------------------------
# conversions
# ---------------------------------------------------------------------------------------------


def lists_from_dense(
    block_map: torch.Tensor, max_k: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense bool block map ``[Bi, H, NQ, NK]`` -> ``(kv_indices, kv_counts)``.

    Indices come out ascending; entries past each row's count are 0. ``K`` is the largest row
    count (at least 1), or ``max_k`` when given (``ValueError`` if a row holds more blocks).
    """
    check_tensor("block_map", block_map, ndim=4, dtypes=(torch.bool,))
    bi, h, nq, nk = block_map.shape
    if nk == 0:
        raise ValueError(
            "block_map must have at least one key block (NK, its last dimension), got shape"
            f" {tuple(block_map.shape)}"
        )
    counts = block_map.sum(dim=-1, dtype=torch.int32)  # [Bi, H, NQ]
    busiest = int(counts.max()) if counts.numel() else 0
    if max_k is None:
        k = max(busiest, 1)
    else:
        k = check_positive_int("max_k", max_k)
        if busiest > k:
            row = _first_position(counts > k)
            raise ValueError(
                f"block_map row {list(row)} attends to {int(counts[row])} key blocks, "
                f"more than max_k={k}"
            )

    rows = block_map.reshape(-1, nk)  # [R, NK]
    row_counts = counts.reshape(-1)  # [R]
    out = torch.zeros(rows.shape[0], k, dtype=torch.int32, device=block_map.device)
    chunk = max(1, _DENSE_CHUNK_ELEMS // max(nk, 1))
    for start in range(0, rows.shape[0], chunk):
        # nonzero lists hits in row-major order, so columns come out ascending within a row
        # and a hit's slot is its rank minus the rank of its row's first hit. Work is
        # O(map + hits), which beats a cumsum over the map for the usual sparse maps.
        r, c = rows[start : start + chunk].nonzero(as_tuple=True)  # [hits], [hits]
        part_counts = row_counts[start : start + chunk]
        first_hit = part_counts.cumsum(0) - part_counts  # [r]
        slot = torch.arange(r.numel(), device=r.device) - first_hit[r]
        out[start + r, slot] = c.to(torch.int32)
    kv_indices = out.reshape(bi, h, nq, k).contiguous()
    return kv_indices, counts


def dense_from_lists(
    kv_indices: torch.Tensor, kv_counts: torch.Tensor, num_kv_blocks: int
) -> torch.Tensor:
    """``(kv_indices, kv_counts)`` -> dense bool block map ``[Bi, H, NQ, NK]``.

    The lists are fully validated first (this is a testing and inspection helper).
    """
    bi, h, nq, k = _check_structure(kv_indices, kv_counts)
    check_positive_int("num_kv_blocks", num_kv_blocks)
    if kv_indices.device.type != "meta":
        _check_values(kv_indices, kv_counts, num_kv_blocks)
    valid = _valid_slots(kv_counts, k)  # [Bi, H, NQ, K]
    # Unread slots write into a spare column NK that is dropped.
    target = torch.where(valid, kv_indices.long(), num_kv_blocks)
    out = torch.zeros(bi, h, nq, num_kv_blocks + 1, dtype=torch.bool, device=kv_indices.device)
    out.scatter_(-1, target, True)
    return out[..., :num_kv_blocks].contiguous()


def transpose_block_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    num_kv_blocks: int,
    q_groups: torch.Tensor | None = None,
    num_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each key block, the query blocks attending to it, in CSR form per (batch, head).

    Returns ``q_offsets`` int32 ``[Bi, H, NK * G + 1]`` and ``q_indices`` int32
    ``[Bi, H, NQ * K]``, where ``G = num_groups``: the query blocks of key block ``j`` in
    group ``g`` are ``q_indices[b, h, q_offsets[b, h, j*G + g] : q_offsets[b, h, j*G + g + 1]]``,
    ascending; with one group (the default) those of key block ``j`` are
    ``q_indices[b, h, q_offsets[b, h, j] : q_offsets[b, h, j + 1]]``. ``q_groups`` (int
    ``[NQ]``, values in ``[0, G)``) puts each query block in its group, so that a kernel can
    walk each group apart (``ops/block_sparse_attn``: query blocks by their real rows)::

        q_groups = [0, 2, 0, 1]  (NQ = 4), G = 3;  key block j listed by query blocks 0, 1, 2, 3
        column j = [0, 2 | 3 | 1]   q_offsets[j*3 : j*3 + 4] = [s, s+2, s+3, s+4]

    Entries past ``q_offsets[b, h, -1]`` are 0. Memory is ``O(Bi * H * NQ * K)``;
    deterministic; no GPU sync.

    Only shapes and dtypes are checked here: this runs in backward passes, after the public
    interface validated the values; an entry out of ``[0, NK)`` (lists changed behind the
    validation's back) is left out, as the forward kernels give it no weight.
    """
    bi, h, nq, k = _check_structure(kv_indices, kv_counts)
    check_positive_int("num_kv_blocks", num_kv_blocks)
    check_positive_int("num_groups", num_groups)
    if (q_groups is None) != (num_groups == 1):
        raise ValueError("q_groups comes with num_groups > 1, and only with it")
    device = kv_indices.device

    # Key (j*G + g_i)*NQ + i for entry (row i -> key block j); unread entries get the sentinel
    # NK*G*NQ so that they sort last. Keys are unique per (b, h) because indices are distinct
    # per row. int32 keys whenever they fit: the GPU radix sort then makes half the passes.
    columns = num_kv_blocks * num_groups
    sentinel = columns * nq
    key_dtype = torch.int32 if sentinel < 2**31 - 1 else torch.int64
    q_rows = torch.arange(nq, device=device, dtype=key_dtype).view(nq, 1)  # [NQ, 1]
    in_range = (kv_indices >= 0) & (kv_indices < num_kv_blocks)
    column = torch.where(in_range, kv_indices, 0).to(key_dtype) * num_groups
    if q_groups is not None:
        column = column + q_groups.to(device=device, dtype=key_dtype).view(nq, 1)
    keys = column * nq + q_rows  # [Bi, H, NQ, K]
    keys = torch.where(_valid_slots(kv_counts, k) & in_range, keys, sentinel)
    keys = keys.reshape(bi * h, nq * k)
    keys = keys.sort(dim=-1, stable=True).values  # [Bi*H, NQ*K]

    # Column c starts at the first key >= c*NQ; a binary search per boundary needs no atomics.
    bounds = torch.arange(columns + 1, device=device, dtype=key_dtype) * nq
    q_offsets = torch.searchsorted(keys, bounds.expand(bi * h, -1).contiguous(), out_int32=True)

    q_indices = torch.where(keys < sentinel, keys % max(nq, 1), 0)
    return (
        q_offsets.reshape(bi, h, columns + 1),
        q_indices.to(torch.int32).reshape(bi, h, nq * k),
    )


def refine_block_lists(
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    ratio: int,
    kv_ratio: int | None = None,
    num_kv_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists over blocks that are each ``ratio`` smaller query blocks and ``kv_ratio`` smaller
    key blocks (default: ``ratio``), as lists over the smaller ones: ``[Bi, H, NQ, K]``,
    ``[Bi, H, NQ]`` -> ``[Bi, H, NQ*ratio, K*kv_ratio]``, ``[Bi, H, NQ*ratio]``. Entry j of a
    row becomes entries ``j*kv_ratio .. j*kv_ratio + kv_ratio-1`` (the valid entries stay
    first), and each row serves its ``ratio`` query blocks.

    Lists that no check saw keep what the kernels make of them: counts are clamped to
    ``[0, K]`` first, and with ``num_kv_blocks`` an entry out of ``[0, num_kv_blocks)``
    becomes ``kv_ratio`` entries out of range (its scaled value could wrap around int32 into
    range)."""
    kv_ratio = ratio if kv_ratio is None else kv_ratio
    idx, cnt = kv_indices, kv_counts
    if kv_ratio > 1:
        if num_kv_blocks is not None:
            idx = torch.where((idx >= 0) & (idx < num_kv_blocks), idx, -1)
        sub = torch.arange(kv_ratio, device=idx.device, dtype=idx.dtype)
        idx = (idx.unsqueeze(-1) * kv_ratio + sub).flatten(-2)  # [Bi, H, NQ, K*kv_ratio]
        cnt = cnt.clamp(0, kv_indices.shape[-1]) * kv_ratio
    if ratio > 1:
        idx, cnt = idx.repeat_interleave(ratio, dim=2), cnt.repeat_interleave(ratio, dim=2)
    return idx.contiguous(), cnt.contiguous()


def refine_block_sizes(sizes: torch.Tensor, ratio: int, block: int) -> torch.Tensor:
    """Real tokens of each of the ``ratio`` blocks of ``block`` rows that a block of
    ``sizes[i]`` real tokens becomes (its real tokens come first, as in a VideoGrid tile):
    full blocks, then one partial, then empty ones. int32 ``[N] -> [N * ratio]``."""
    if ratio == 1:
        return sizes
    start = torch.arange(ratio, device=sizes.device) * block  # [ratio]
    return (sizes.long().unsqueeze(-1) - start).clamp(0, block).flatten().to(torch.int32)


# ---------------------------------------------------------------------------------------------
# generators and statistics
# ---------------------------------------------------------------------------------------------


def random_block_lists(
    batch: int,
    heads: int,
    num_q_blocks: int,
    num_kv_blocks: int,
    *,
    density: float | None = None,
    count: int | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random lists ``[batch, heads, NQ, K]``, ``[batch, heads, NQ]`` for tests and benchmarks.

    Each row picks distinct key blocks uniformly at random, independently per
    (batch, head, row), listed ascending. Give exactly one of:

    - ``density`` in ``(0, 1]``: every row holds ``max(1, round(density * NK))`` blocks;
    - ``count``: an int in ``[0, NK]`` (0 gives empty rows), or an integer tensor broadcastable
      to ``[batch, heads, NQ]`` for ragged rows.

    ``K`` is the largest count (at least 1). ``generator`` must live on ``device``.
    """
    _check_block_grid(batch, heads, num_q_blocks, num_kv_blocks)
    if (density is None) == (count is None):
        raise ValueError("random_block_lists needs exactly one of density and count")
    device = torch.device("cpu") if device is None else torch.device(device)
    shape = (batch, heads, num_q_blocks)

    if density is not None:
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise TypeError(f"density must be a float, got {density!r}")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must lie in (0, 1], got {density}")
        count = max(1, round(density * num_kv_blocks))
    if isinstance(count, torch.Tensor):
        if count.is_floating_point() or count.dtype == torch.bool:
            raise TypeError(f"count must be an integer tensor, got dtype {count.dtype}")
        counts = count.to(device=device, dtype=torch.int32).expand(shape).contiguous()
    else:
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int or an integer tensor, got {count!r}")
        counts = torch.full(shape, count, dtype=torch.int32, device=device)
    lo = int(counts.min())
    hi = int(counts.max())
    if lo < 0 or hi > num_kv_blocks:
        raise ValueError(f"count must lie in [0, num_kv_blocks={num_kv_blocks}], got [{lo}, {hi}]")
    k = max(hi, 1)

    # The top-k of i.i.d. uniform scores is a uniform random k-subset.
    scores = torch.rand(*shape, num_kv_blocks, generator=generator, device=device)
    picked = scores.topk(k, dim=-1, sorted=False).indices  # [B, H, NQ, K]
    # Keep the first `count` picks of each row, then sort so they come first and ascending.
    valid = _valid_slots(counts, k)
    picked = torch.where(valid, picked, num_kv_blocks).sort(dim=-1).values
    kv_indices = torch.where(valid, picked, 0).to(torch.int32)
    return kv_indices, counts


def block_density(kv_counts: torch.Tensor, num_kv_blocks: int) -> float:
    """Fraction of (query block, key block) pairs that are computed (0.0 for empty input)."""
    check_tensor("kv_counts", kv_counts)
    check_positive_int("num_kv_blocks", num_kv_blocks)
    if kv_counts.numel() == 0:
        return 0.0
    return float(kv_counts.sum(dtype=torch.float64)) / (kv_counts.numel() * num_kv_blocks)
