"""``apply_sequence_parallel``'s errors, in one process (its training runs are in
``tests/examples/test_finetune_vsa_parallel.py``, on 2 and 4 gloo processes): a model without
a ``_cp_plan`` or one that cannot be sharded (LTX-2), no process group, and a sequence that
does not split (named at the forward, before any collective), with torch's "fake" process
group of size 2; and ``remove``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("diffusers")

from test_integration_diffusers import tiny_wan  # noqa: E402

from vidsparse.integrations.diffusers import apply_sequence_parallel  # noqa: E402


@pytest.fixture
def fake_group(monkeypatch):
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        pytest.skip("torch's fake process group is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def no_comm(*args, **kwargs):
        raise AssertionError("a collective was started before the error")

    monkeypatch.setattr(dist, "all_gather", no_comm)
    yield
    dist.destroy_process_group()


def test_a_model_without_a_plan_or_a_group_is_refused():
    with pytest.raises(ValueError, match="Linear has no _cp_plan"):
        apply_sequence_parallel(nn.Linear(2, 2))
    ltx2 = type("LTX2VideoTransformer3DModel", (nn.Module,), {"_cp_plan": {"": {}}})()
    with pytest.raises(ValueError, match="LTX2VideoTransformer3DModel cannot be sequence-sharded"):
        apply_sequence_parallel(ltx2)
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        apply_sequence_parallel(tiny_wan())


def test_a_sequence_that_does_not_split_names_the_sizes(fake_group):
    model = tiny_wan()
    sharding = apply_sequence_parallel(model)
    latents = torch.randn(1, 4, 3, 14, 18)  # 3 x 7 x 9 = 189 tokens over 2 ranks
    text = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match=r"\(1, 189, 1, 16\) tensor into 2 equal chunks: 189"):
        model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text)
    sharding.remove()
    assert sharding.modules == []
    model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text)
