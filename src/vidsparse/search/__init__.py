"""PSA offline search: candidate family, objective, search, plan files, synthetic heads.

Pure PyTorch at import time (no Triton): the objective calls the public block-sparse engine,
which picks its backend lazily. Typical use::

    from vidsparse.search import load_calibration, search, save_plan
    samples = load_calibration("calib/")     # a capture's .safetensors files (or older .pt)
    grid = VideoGrid(samples.recorded("grid_shape")[0], tile=(2, 8, 8))
    result = search(samples, grid, alpha=0.05)   # num_steps: what the files record
    result.table.save("losses.pt")           # re-plan later: plan_from_table(LossTable.load(..))
    save_plan(result.plan, "plan.json")
    specs = result.plan.specs_for(step, layer)   # -> stripe_attn(..., spatial_unit="block")
"""

from vidsparse.search.calibration import (
    CALIBRATION_SUFFIXES,
    CalibrationFiles,
    CalibrationInfo,
    CalibrationSample,
    load_calibration,
    save_calibration_sample,
)
from vidsparse.search.candidates import (
    AxisRange,
    Candidate,
    CandidateFamily,
    CandidateSet,
    candidate_factors,
    candidate_sparsity,
)
from vidsparse.search.objective import (
    LossStats,
    StripeObjective,
    choose_query_blocks,
    engine_block_size,
    stripe_losses,
)
from vidsparse.search.plan import (
    PLAN_FORMAT,
    PLAN_VERSION,
    HeadChoice,
    Plan,
    PlanBucket,
    load_plan,
    save_plan,
)
from vidsparse.search.search import (
    LossTable,
    SearchResult,
    build_loss_table,
    dense_step_count,
    plan_from_table,
    search,
    select_candidates,
)
from vidsparse.search.synthetic import SyntheticHeads, planted_stripe_heads

__all__ = [
    "AxisRange",
    "Candidate",
    "CandidateFamily",
    "CandidateSet",
    "candidate_factors",
    "candidate_sparsity",
    "LossStats",
    "StripeObjective",
    "stripe_losses",
    "choose_query_blocks",
    "engine_block_size",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "HeadChoice",
    "Plan",
    "PlanBucket",
    "load_plan",
    "save_plan",
    "CALIBRATION_SUFFIXES",
    "CalibrationSample",
    "CalibrationInfo",
    "CalibrationFiles",
    "load_calibration",
    "save_calibration_sample",
    "LossTable",
    "SearchResult",
    "build_loss_table",
    "plan_from_table",
    "search",
    "select_candidates",
    "dense_step_count",
    "SyntheticHeads",
    "planted_stripe_heads",
]
