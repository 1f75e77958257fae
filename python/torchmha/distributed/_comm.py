"""Collectives with the autograd rules of tensor parallelism (Megatron's f and g): every rank holds
the same (replicated) input and computes the same loss from the same output, so the gradient of a
replicated input is the sum of the ranks' partial gradients, and the gradient of a summed output
reaches every rank's partial unchanged. torch.distributed.nn.functional's all_reduce sums in both
directions, which would count the replicated loss P times."""

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor


class _CopyToParallel(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    """Forward: all-gather along dim, in rank order. Backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, dist.get_rank(group), x.size(dim)
        parts = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def copy_to_parallel(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: Tensor, dim: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    return _GatherFromParallel.apply(x, dim, group)
