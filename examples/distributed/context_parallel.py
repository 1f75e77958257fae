"""Context-parallel (ring) causal self-attention:
torchrun --nproc-per-node 2 examples/distributed/context_parallel.py
Each rank holds a contiguous slice of the sequence and gets that slice of the output."""

import torch
import torch.distributed as dist
from torch import nn

import torchmha

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
mha = nn.MultiheadAttention(64, 8, batch_first=True)
attention = torchmha.distributed.ContextParallelAttention(mha)
length = 1024
x = torch.randn(2, length, 64)  # here every rank makes the whole sequence only to check the result
rows = slice(rank * length // world, (rank + 1) * length // world)
out = attention(x[:, rows], is_causal=True)
mask = nn.Transformer.generate_square_subsequent_mask(length)
expected = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0][:, rows]
torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
print(f"rank {rank}: positions [{rows.start}, {rows.stop}) of {length}, output {tuple(out.shape)} matches one process")
dist.destroy_process_group()
