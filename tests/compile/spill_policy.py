"""Which Tritons the spill checks hold to (no side effects: safe to import in the test process,
unlike ``compile_kernels.py``, which unsets ``TRITON_INTERPRET`` when imported)."""

from __future__ import annotations

# The Tritons whose register use the spill checks hold to (CI's two toolchains: .ci/run). With
# another Triton the kernels are still compiled and checked to compile, but spills (which move
# with each Triton's LLVM and ptxas) are reported, not failed: a new Triton is measured, and its
# accepted spills listed, before it joins this tuple.
CHECKED_TRITONS = ("3.6", "3.8")


def triton_minor() -> str:
    """The installed Triton as ``major.minor``."""
    import triton

    return ".".join(triton.__version__.split(".")[:2])


def spills_unchecked(spills: list[str], kind: str = "spills") -> str | None:
    """Why ``kind`` (spills, or ptxas notes) are only reported here (a Triton outside
    ``CHECKED_TRITONS``), or None."""
    version = triton_minor()
    if version in CHECKED_TRITONS:
        return None
    listed = "; ".join(spills) or "none"
    checked = ", ".join(CHECKED_TRITONS)
    return (
        f"Triton {version} is not one the spill checks were measured on ({checked}): "
        f"its {kind} are reported, not failed: {listed}"
    )
