"""VSA's device code only: the coarse stage's kernels (``pool.py``, ``coarse_topk.py``, launched
from ``../coarse.py``) and the fine stage's gate combine (``combine*.py``, from ``../fine.py``)."""
