"""Trainable modules: :class:`VideoSparseAttention` (VSA with a learned gate) and
:class:`SparsitySchedule` (start dense, raise sparsity stepwise to a target)."""

from vidsparse.nn.schedule import SparsitySchedule
from vidsparse.nn.vsa import VideoSparseAttention, VSAGate

__all__ = ["SparsitySchedule", "VSAGate", "VideoSparseAttention"]
