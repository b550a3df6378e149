"""Occupancy of a kernel compiled for AMD CDNA3 (gfx942, MI300) or CDNA4 (gfx950, MI350): waves
per SIMD, from what its code object allocates. No side effects: the test process imports it
too (``compile_kernels.py`` unsets ``TRITON_INTERPRET`` when imported).

The rules are those of LLVM's AMDGPU backend (``GCNSubtarget``, ``AMDGPUBaseInfo``) and its
AMDGPUUsage document for these two targets:

- a CU has 4 SIMDs, each runs at most 8 waves of 64 lanes (a Triton warp is one wave);
- VGPRs: 512 per lane and SIMD, architectural VGPRs and AGPRs in one file, allocated in
  granules of 8. A wave holds what the kernel descriptor asks for: LLVM's
  ``NumVGPRsForWavesPerEU``, the registers used raised so that no more waves fit than the
  kernel's ``amdgpu-waves-per-eu`` maximum (Triton's ``waves_per_eu``) allows;
- SGPRs (GFX9 generation): up to 100 a wave (VCC and the other reserved ones included) keep 8
  waves, more keep 7;
- LDS: 64 KiB a CU on gfx942, allocated per workgroup in blocks of 128 dwords; 160 KiB on
  gfx950, in blocks of 320 dwords. Triton's LDS is dynamic (the launch asks for
  ``metadata.shared``), so LLVM's own ``; Occupancy`` comment does not count it;
- a workgroup's waves are resident together, spread over the 4 SIMDs, so whole workgroups
  count: at most 16 a CU (one barrier each) and 32 waves.
"""

from __future__ import annotations

import math

SIMDS_PER_CU = 4
MAX_WAVES_PER_SIMD = 8
VGPRS_PER_SIMD = 512  # per lane, VGPRs and AGPRs together
VGPR_GRANULE = 8
MAX_WORKGROUPS_PER_CU = 16  # barriers; a one-wave workgroup takes none
# arch -> (LDS bytes a CU, LDS allocation block in bytes)
LDS = {"gfx942": (64 * 1024, 128 * 4), "gfx950": (160 * 1024, 320 * 4)}


def waves_by_vgprs(vgprs: int) -> int:
    """Waves a SIMD holds of a kernel whose waves each take ``vgprs`` VGPRs (0: none fit)."""
    if vgprs <= 0:
        return MAX_WAVES_PER_SIMD
    return min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD // _round_up(vgprs, VGPR_GRANULE))


def waves_by_sgprs(sgprs: int) -> int:
    """GFX9: 80, 88 and 100 SGPRs keep 10, 9 and 8 waves; more, 7 (8 is the CDNA maximum)."""
    return MAX_WAVES_PER_SIMD if sgprs <= 100 else 7


def occupancy(arch: str, num_warps: int, vgprs: int, sgprs: int, lds_bytes: int) -> dict:
    """``{"occupancy": waves per SIMD, "occupancy_limit": what bounds it, "waves_by_registers":
    the bound of the registers alone (what LLVM's ``; Occupancy`` comment says)}`` for
    workgroups of ``num_warps`` waves taking ``vgprs`` and ``sgprs`` a wave (as allocated) and
    ``lds_bytes`` of LDS. 0 waves: a workgroup does not fit on a CU at all."""
    lds_per_cu, lds_block = LDS[arch]
    by_vgprs, by_sgprs = waves_by_vgprs(vgprs), waves_by_sgprs(sgprs)
    workgroups = {  # whole workgroups a CU holds, by each resource (ties name the first)
        "waves": MAX_WAVES_PER_SIMD * SIMDS_PER_CU // num_warps,
        "vgprs": by_vgprs * SIMDS_PER_CU // num_warps,
        "sgprs": by_sgprs * SIMDS_PER_CU // num_warps,
        "lds": lds_per_cu // _round_up(lds_bytes, lds_block) if lds_bytes else math.inf,
        "barriers": MAX_WORKGROUPS_PER_CU if num_warps > 1 else math.inf,
    }
    limit = min(workgroups, key=workgroups.get)
    return {
        "occupancy": workgroups[limit] * num_warps // SIMDS_PER_CU,
        "occupancy_limit": limit,
        "waves_by_registers": min(by_vgprs, by_sgprs),
    }


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule
