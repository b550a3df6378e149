"""Where the time of one Ulysses VSA layer goes on each rank: per-kernel GPU time and each CUDA
stream's busy time (torch.profiler), next to the wall time of the call.

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/profile/profile_parallel.py \\
        --head-chunks 2

The layer is the parallel benchmark's (``vidsparse.bench.ops.parallel``: Wan 14B 720p, 40
heads, VSA sparsity 0.875, gate).
Rank 0 prints its table and writes a Chrome trace (``--trace``) for a closer look.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from vidsparse.bench.ops.parallel import (
    WAN14B_720P,
    init_distributed,
    local_shard,
    vsa_case,
)


def stream_busy_ms(prof) -> dict[int, float]:
    """Union of kernel and copy intervals per CUDA stream, in ms."""
    spans = defaultdict(list)
    for e in prof.events():
        if (
            e.device_type == torch.autograd.DeviceType.CUDA
            and e.time_range.end > e.time_range.start
        ):
            spans[getattr(e, "device_resource_id", 0)].append(
                (e.time_range.start, e.time_range.end)
            )
    busy = {}
    for stream, ivs in spans.items():
        ivs.sort()
        total, cur_s, cur_e = 0, None, None
        for s, e in ivs:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        busy[stream] = total / 1e3
    return busy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-chunks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--trace", default=None, help="Chrome trace path (rank 0)")
    ap.add_argument("--normal-priority", action="store_true", help="NCCL stream priority")
    args = ap.parse_args(argv)
    device = init_distributed(cpu=False, high_priority=not args.normal_priority)
    case = vsa_case(WAN14B_720P, 0.875, torch.bfloat16, device)
    shards = [local_shard(x) for x in case.full_inputs]

    def call():
        with torch.no_grad():
            return case.sharded(*shards, head_chunks=args.head_chunks)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start.record()
        for _ in range(args.calls):
            call()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) / args.calls
    if dist.get_rank() == 0:
        print(f"head_chunks={args.head_chunks}: {wall:.2f} ms a call (wall, under the profiler)")
        for stream, ms in sorted(stream_busy_ms(prof).items()):
            print(f"stream {stream}: busy {ms / args.calls:.2f} ms a call")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        print(table)
        if args.trace:
            prof.export_chrome_trace(args.trace)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
