"""torchmha.distributed: attention past one process, over torch.distributed.

- :func:`parallelize_heads`: head (tensor) parallelism; the heads and their projection weights
  are split over the ranks as DTensors, one all-reduce per forward.
- :class:`ContextParallelAttention`: context (sequence) parallelism; each rank holds a slice of
  the sequence, keys and values pass around a ring (ring attention).
- :class:`SavePlanner`, :class:`LoadPlanner`: DCP planners that also handle the head-parallel
  packed projection (a strided shard).
"""

from ._checkpoint import LoadPlanner, SavePlanner
from ._context_parallel import ContextParallelAttention
from ._head_parallel import HeadParallelMultiheadAttention, fsdp_shard_placement, parallelize_heads

__all__ = [
    "ContextParallelAttention",
    "HeadParallelMultiheadAttention",
    "LoadPlanner",
    "SavePlanner",
    "fsdp_shard_placement",
    "parallelize_heads",
]
