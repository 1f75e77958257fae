"""DCP planners for DTensors with a _StridedShard placement (head-parallel in_proj_weight).

DCP describes each rank's piece of a DTensor as one box (offset, size); a strided shard is several
boxes (for in_proj_weight: this rank's q rows, k rows and v rows), and the default planners write it
as one wrong box. These planners list each run of consecutive global rows as its own chunk and hand
DCP the matching local view, so saving writes torch's layout and loading reads from any sharding
(2 ranks to 4, or a plain tensor). Everything else goes through DCP's default planners unchanged.
"""

import dataclasses
from typing import Any, Dict, List, Tuple

from typing_extensions import TypeGuard

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

Chunk = Tuple[ChunkStorageMetadata, Tuple[int, int]]  # the box, and its rows [start, end) in the local tensor


def _is_strided(obj: Any) -> TypeGuard[DTensor]:
    return isinstance(obj, DTensor) and any(isinstance(p, _StridedShard) for p in obj.placements)


def _chunks(t: DTensor) -> List[Chunk]:
    """The boxes of t's local tensor: runs of consecutive global rows (dim 0); other dims as DCP's."""
    on_rows = [p for p in t.placements if isinstance(p, (Shard, _StridedShard)) and p.dim == 0]
    row_placements = [p if p in on_rows else Replicate() for p in t.placements]
    # The global row of each local row: distribute the row numbers the way t is distributed
    # (src_data_rank=None: each rank cuts its own copy, no communication).
    rows = distribute_tensor(
        torch.arange(t.shape[0]), t.device_mesh, row_placements, src_data_rank=None
    ).to_local().tolist()
    other = [Replicate() if p in on_rows else p for p in t.placements]
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, other)
    chunks: List[Chunk] = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            chunks.append((
                ChunkStorageMetadata(
                    offsets=torch.Size([rows[start], *offsets[1:]]), sizes=torch.Size([i - start, *sizes[1:]])
                ),
                (start, i),
            ))
            start = i
    return chunks


def _local_view(t: DTensor, index: MetadataIndex) -> torch.Tensor:
    for chunk, (start, end) in _chunks(t):
        if index.offset is None or chunk.offsets == index.offset:
            return t.to_local()[start:end]
    raise ValueError(f"no local chunk of {index.fqn} at offset {index.offset}")


class SavePlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner, also for strided shards (head-parallel parameters):
    ``dcp.save(model.state_dict(), checkpoint_id=path, planner=torchmha.distributed.SavePlanner())``."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: List[WriteItem] = []
        for item in plan.items:
            obj = self.state_dict.get(item.index.fqn)
            if not _is_strided(obj):
                items.append(item)
                continue
            assert item.tensor_data is not None
            for chunk, _ in _chunks(obj):
                items.append(WriteItem(
                    index=MetadataIndex(item.index.fqn, chunk.offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=item.tensor_data.properties,
                                                size=item.tensor_data.size),
                ))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return _local_view(obj, index) if _is_strided(obj) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, also for strided shards (head-parallel parameters):
    ``dcp.load(state_dict, checkpoint_id=path, planner=torchmha.distributed.LoadPlanner())``, then
    ``model.load_state_dict(state_dict)``. Loads from any number of ranks' checkpoint."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        strided: Dict[str, DTensor] = {k: v for k, v in self.state_dict.items() if _is_strided(v)}
        items = [item for item in plan.items if item.dest_index.fqn not in strided]
        for fqn, t in strided.items():
            if fqn in self.metadata.state_dict_metadata:
                chunks = [chunk for chunk, _ in _chunks(t)]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)  # type: ignore[arg-type]
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return _local_view(obj, index) if _is_strided(obj) else super().lookup_tensor(index)
