"""Head (tensor) parallelism for multi-head attention: parallelize_heads.

Each of P ranks owns num_heads / P heads: their rows of the input projections and the matching
columns of out_proj.weight, held as DTensors. A rank's forward is multi-head attention over its own
heads (torchmha's core op), a partial output projection without bias, one all-reduce (sum) and the
bias. The packed in_proj_weight (3E, E) stacks q, k and v, so a rank's rows are three blocks, one in
each third: the placement is _StridedShard(0, split_factor=3), torch's own for a dimension sharded
inside a flattened one; full_tensor() and state_dict() keep torch's layout and names, and
torchmha.distributed.SavePlanner / LoadPlanner let DCP write and read such a shard (_checkpoint.py).
The packed in_proj_bias (3E) is replicated: each rank reads its heads' entries, and their gradients
are summed over the ranks in backward (a 3E all-reduce).
"""

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from .._ops import attention_options, attention_parameters, ops
from ..functional import warn_if_mask_dtypes_differ
from ..multihead_attention import MultiheadAttention
from ._comm import copy_to_parallel, gather_from_parallel, reduce_from_parallel

MeshOrGroup = Union[DeviceMesh, dist.ProcessGroup, None]


def as_mesh(mesh_or_group: MeshOrGroup, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh: the one given, or one over a process group (None: the default group)."""
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise ValueError(
                f"mesh_or_group must be a 1-D DeviceMesh (the head-parallel dimension, e.g. mesh['tp']), "
                f"got a {mesh_or_group.ndim}-D mesh with shape {tuple(mesh_or_group.shape)}"
            )
        return mesh_or_group
    if not dist.is_initialized():
        raise RuntimeError("torchmha.distributed needs an initialized process group (dist.init_process_group)")
    group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
    assert group is not None
    return DeviceMesh.from_group(group, device_type)


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


class HeadParallelMultiheadAttention(MultiheadAttention):
    """A MultiheadAttention whose heads are spread over the ranks of ``tp_mesh`` (made by
    :func:`parallelize_heads`; not constructed directly). Forward has torch's signature and returns
    torch's ``(output, weights)`` on every rank: the whole input in, the whole output out.

    Attention weights (need_weights=True): with average_attn_weights the all-reduced sum of each
    rank's average over its heads, divided by P (= the mean over all heads); without it, the
    ranks' per-head weights all-gathered in head order.
    """

    tp_mesh: DeviceMesh

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        warn_if_mask_dtypes_differ(key_padding_mask, attn_mask)
        group = self.tp_mesh.get_group()
        parts = self.tp_mesh.size()
        local_heads = self.num_heads // parts
        rank = self.tp_mesh.get_local_rank()

        # The inputs are replicated; each rank's heads add a part to their gradients (f).
        inputs = {}
        for t in (query, key, value):
            if id(t) not in inputs:
                inputs[id(t)] = copy_to_parallel(t, group) if t.requires_grad else t
        query, key, value = inputs[id(query)], inputs[id(key)], inputs[id(value)]

        if self._qkv_same_embed_dim:  # (3E/P, E): this rank's q, k and v rows
            in_w, q_w, k_w, v_w = _local(self.in_proj_weight), None, None, None
        else:
            in_w, q_w, k_w, v_w = None, _local(self.q_proj_weight), _local(self.k_proj_weight), _local(self.v_proj_weight)
        in_bias = _local(self.in_proj_bias)  # replicated (3E,): this rank takes its heads' entries
        if in_bias is not None:
            if in_bias.requires_grad:  # each rank's gradient covers its own heads' entries: sum them
                in_bias = copy_to_parallel(in_bias, group)
            ours = slice(rank * (self.embed_dim // parts), (rank + 1) * (self.embed_dim // parts))
            in_bias = torch.cat([part[ours] for part in in_bias.chunk(3)])
        if attn_mask is not None and attn_mask.dim() == 3:  # (N * H, L, S) or unbatched (H, L, S): our heads
            mask = attn_mask.unflatten(0, (-1, self.num_heads))
            attn_mask = mask[:, rank * local_heads:(rank + 1) * local_heads].flatten(0, 1)
        # head_dim: the core projects query, key and value to this rank's heads (width E/P) itself.
        params = attention_parameters(
            local_heads, self.head_dim, in_w, in_bias, q_w, k_w, v_w, bias_k=_local(self.bias_k),
            bias_v=_local(self.bias_v), add_zero_attn=self.add_zero_attn, out_proj_weight=_local(self.out_proj.weight),
        )
        options = attention_options(
            key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal, self.training,
            self.batch_first, self.dropout,
        )
        partial, weights = ops.multi_head_attention_forward(query, key, value, self.embed_dim, *params, *options)
        output = reduce_from_parallel(partial, group)  # the one all-reduce (g)
        out_bias = _local(self.out_proj.bias)
        if out_bias is not None:
            output = output + out_bias
        if weights is not None:
            if average_attn_weights:
                weights = reduce_from_parallel(weights, group) / parts
            else:  # (N, H/P, L, S) or unbatched (H/P, L, S)
                weights = gather_from_parallel(weights, weights.dim() - 3, group)
        return output, weights


def _shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    if param is None or isinstance(param, DTensor):
        return
    module.register_parameter(
        name, nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]), requires_grad=param.requires_grad)
    )


def _parallelize_one(mha: nn.MultiheadAttention, mesh: DeviceMesh) -> None:
    rows = _StridedShard(0, split_factor=3)  # q, k and v rows of our heads: one block per third
    _shard_parameter(mha, "in_proj_weight", mesh, rows)
    # The packed bias (3E elements) is replicated, not strided like the weight: FSDP2 can only shard
    # a 1-D parameter on dim 0 again, and DTensor's full_tensor() gets that nesting of two strided
    # shards wrong (torch 2.13); the default DCP planners read and write a replicated tensor as is.
    _shard_parameter(mha, "in_proj_bias", mesh, Replicate())
    for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        _shard_parameter(mha, name, mesh, Shard(0))
    _shard_parameter(mha, "bias_k", mesh, Shard(2))  # (1, 1, E): per-head features
    _shard_parameter(mha, "bias_v", mesh, Shard(2))
    _shard_parameter(mha.out_proj, "weight", mesh, Shard(1))
    _shard_parameter(mha.out_proj, "bias", mesh, Replicate())
    mha.__class__ = HeadParallelMultiheadAttention
    setattr(mha, "tp_mesh", mesh)  # noqa: B010 (the attribute of the new class)


def parallelize_heads(module: nn.Module, mesh_or_group: MeshOrGroup = None) -> nn.Module:
    """Makes ``module`` (a ``torch.nn.MultiheadAttention``, torchmha's or torch's) and every
    MultiheadAttention inside it head-parallel over ``mesh_or_group`` (a 1-D DeviceMesh, a
    ProcessGroup, or None for the default group), in place, and returns it.

    Each of the P ranks keeps num_heads / P heads: their rows of in_proj_weight (or of
    q/k/v_proj_weight) and bias_k / bias_v features, and the matching columns of out_proj.weight,
    as DTensors; in_proj_bias and out_proj.bias are replicated. ``state_dict()`` keeps torch's
    names and global shapes, ``full_tensor()`` torch's layout. Every rank must call forward with the
    same inputs; it returns the whole output. Parameters are taken from rank 0 (distribute_tensor).
    Subclasses other than torchmha's are left alone, as in replace_multihead_attention.
    """
    modules: List[nn.MultiheadAttention] = [
        m for m in module.modules()
        if isinstance(m, nn.MultiheadAttention) and type(m) in (nn.MultiheadAttention, MultiheadAttention)
    ]
    if not modules:
        return module
    mesh = as_mesh(mesh_or_group, modules[0].out_proj.weight.device.type)
    for mha in modules:  # every check before anything changes
        if mha.num_heads % mesh.size() != 0:
            raise ValueError(
                f"parallelize_heads: num_heads ({mha.num_heads}) must be divisible by the number of ranks "
                f"in mesh_or_group ({mesh.size()}), so that each rank owns num_heads / {mesh.size()} whole heads"
            )
    for mha in modules:
        _parallelize_one(mha, mesh)
    return module


def fsdp_shard_placement(param: nn.Parameter) -> Optional[Shard]:
    """For FSDP2's ``fully_shard(..., shard_placement_fn=fsdp_shard_placement)`` on a 2-D mesh with
    head parallelism on the other dimension: FSDP2 shards the columns (dim 1) of a head-parallel
    in_proj_weight, whose rows are already a strided shard (three blocks) over the heads; FSDP2's
    default, dim 0 again, nests two strided shards, which DTensor's full_tensor() does not undo
    correctly in torch 2.13. Every other parameter: FSDP2's default (None)."""
    if isinstance(param, DTensor) and param.dim() == 2 and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return None
