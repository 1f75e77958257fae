"""Head-parallel self-attention: torchrun --nproc-per-node 2 examples/distributed/head_parallel.py
Each rank keeps half the heads; every rank gets the whole output, equal to one process's."""

import copy

import torch
import torch.distributed as dist
from torch import nn

import torchmha

dist.init_process_group("gloo")
torch.manual_seed(0)
reference = nn.MultiheadAttention(64, 8, batch_first=True)
mha = torchmha.distributed.parallelize_heads(copy.deepcopy(reference))  # default process group
x = torch.randn(2, 16, 64)  # the same input on every rank (same seed)
out, weights = mha(x, x, x)
torch.testing.assert_close(out, reference(x, x, x)[0], atol=1e-5, rtol=1e-5)
print(f"rank {dist.get_rank()}: in_proj_weight local {tuple(mha.in_proj_weight.to_local().shape)} "
      f"of {tuple(mha.in_proj_weight.shape)}; output {tuple(out.shape)} matches one process")
dist.destroy_process_group()
