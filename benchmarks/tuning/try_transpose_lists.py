"""The backward's transposed lists built alone: the bitmap kernels (``lists.transpose_lists``,
the default) against the sort in PyTorch (``masks.transpose_block_lists``), each checked
equal to the other on the timed lists, then timed alternately (``do_bench`` medians of three
rounds an arm). VSA's lists are new every call, so its backward builds them every call; the
whole backward's A/B is ``try_bwd_overlap.py --study transpose-kernels``.

Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/tuning/try_transpose_lists.py

Cases (random per-head lists, every row full): ``vsa480`` (Wan 1.3B 480p at sparsity 0.875:
12 heads, 624 tiles, 78 listed a row, three query groups as dK/dV's short walks take them),
``vsa720`` (Wan 14B 720p: 40 heads, 1,440 tiles, 180 a row, three groups) and ``engine``
(S=32,768 at 128x128, density 1/8: 12 heads, 256 blocks, 32 a row, one group). Writes
``$OUT/try_transpose_lists.json`` if ``OUT`` is set; prints each row as JSON last.
"""

from __future__ import annotations

import contextlib
import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is defined: real kernels only

import torch  # noqa: E402

CASES = {  # heads, blocks (query = key), listed a row, query groups
    "vsa480": (12, 624, 78, 3),
    "vsa720": (40, 1440, 180, 3),
    "engine": (12, 256, 32, 1),
}


def _lists(heads, blocks, listed, groups):
    from vidsparse.masks.block_sparse import random_block_lists

    gen = torch.Generator().manual_seed(blocks)
    idx, cnt = random_block_lists(1, heads, blocks, blocks, count=listed, generator=gen)
    q_groups = torch.randint(0, groups, (blocks,), generator=gen) if groups > 1 else None
    to_gpu = (lambda t: None if t is None else t.cuda())  # fmt: skip
    return to_gpu(idx), to_gpu(cnt), to_gpu(q_groups)


def run_case(name: str) -> list[dict]:
    from vidsparse.bench import harness
    from vidsparse.masks.block_sparse import transpose_block_lists
    from vidsparse.ops.block_sparse_attn.lists import transpose_lists

    heads, blocks, listed, groups = CASES[name]
    idx, cnt, q_groups = _lists(heads, blocks, listed, groups)
    builders = {"sort": transpose_block_lists, "kernels": transpose_lists}
    built = {arm: fn(idx, cnt, blocks, q_groups, groups) for arm, fn in builders.items()}
    same = all(torch.equal(a, b) for a, b in zip(built["sort"], built["kernels"]))
    print(f"{name}: the kernels' lists equal the sort's: {same}", flush=True)

    chosen = {}

    @contextlib.contextmanager
    def enter(arm):  # alternating_ms times make_fn() inside it
        chosen["build"] = builders[arm]
        yield

    def make_fn():
        build = chosen["build"]
        return lambda: build(idx, cnt, blocks, q_groups, groups)

    times = harness.alternating_ms(builders, enter, make_fn, device=idx.device)
    rows = []
    for arm, ms_all in times.items():
        ms = sorted(ms_all)[1]
        rows.append(dict(case=name, arm=arm, ms=ms, ms_all=ms_all, equal=same))
        print(f"{name} {arm}: {ms * 1e3:.1f} us {ms_all}", flush=True)
    return rows


def main() -> None:
    from vidsparse.bench import harness

    rows = [row for name in CASES for row in run_case(name)]
    harness.emit_tuning_rows("try_transpose_lists.json", rows, "try_transpose_lists")


if __name__ == "__main__":
    main()
