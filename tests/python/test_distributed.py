"""torchmha under torch.distributed: two processes (gloo, loopback) train a small model with
torchmha.MultiheadAttention wrapped in DistributedDataParallel or FSDP2 (fully_shard), each on its
half of a global batch; gradients at every step and parameters at the end must equal those of one
process training on the whole batch (float64)."""

import copy
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchmha
from helpers import finish_rank

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8
TOLERANCE = dict(atol=1e-12, rtol=1e-10)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]


class TinyAttentionModel(nn.Module):
    """Self-attention and a linear head; one scalar prediction per sequence."""

    def __init__(self, embed_dim=16, num_heads=4):
        super().__init__()
        self.attention = torchmha.MultiheadAttention(embed_dim, num_heads, batch_first=True, dtype=torch.float64)
        self.head = nn.Linear(embed_dim, 1, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0]).mean(dim=(1, 2))


def _global_batch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 5, 16, dtype=torch.float64, generator=generator)
    y = torch.randn(GLOBAL_BATCH, dtype=torch.float64, generator=generator)
    return x, y


def _train(model, parameters_by_name, x, y, full_tensor):
    """STEPS of SGD on (x, y); returns the gradients of every step and the final parameters, by name,
    as plain tensors (full_tensor gathers FSDP2's sharded DTensors)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        gradients.append({name: full_tensor(p.grad).clone() for name, p in parameters_by_name().items()})
        optimizer.step()
    return gradients, {name: full_tensor(p).detach().clone() for name, p in parameters_by_name().items()}


def _plain(tensor):
    return tensor


def _gathered(tensor):
    return tensor.full_tensor()


def _worker(rank, port, wrapper):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on the loopback interface
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        single = TinyAttentionModel()
        distributed = copy.deepcopy(single)
        x, y = _global_batch()

        expected_gradients, expected_parameters = _train(single, lambda: dict(single.named_parameters()), x, y, _plain)

        shard = slice(rank * GLOBAL_BATCH // WORLD_SIZE, (rank + 1) * GLOBAL_BATCH // WORLD_SIZE)
        if wrapper == "ddp":
            model = nn.parallel.DistributedDataParallel(distributed)
            full_tensor = _plain
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD_SIZE,))
            fully_shard(distributed.attention, mesh=mesh)
            model = fully_shard(distributed, mesh=mesh)
            full_tensor = _gathered
        gradients, parameters = _train(model, lambda: dict(distributed.named_parameters()), x[shard], y[shard], full_tensor)

        for step, (actual, expected) in enumerate(zip(gradients, expected_gradients)):
            assert actual.keys() == expected.keys()
            for name in expected:
                torch.testing.assert_close(actual[name], expected[name], **TOLERANCE, msg=f"step {step} grad {name}")
        for name in expected_parameters:
            torch.testing.assert_close(parameters[name], expected_parameters[name], **TOLERANCE, msg=f"parameter {name}")
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()


def _free_loopback_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_two_processes_match_single_process_training(wrapper):
    mp.spawn(_worker, args=(_free_loopback_port(), wrapper), nprocs=WORLD_SIZE, join=True)
