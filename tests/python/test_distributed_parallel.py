"""torchmha.distributed: head-parallel and context-parallel attention on gloo (CPU), 2 and 4
processes spawned here, against one process's torch.nn.MultiheadAttention on the same weights:
forward and gradients (inputs and parameters) to float64 1e-10 and float32 1e-5, DCP checkpoints
(and resharding from 2 ranks to 4), composition with nn.Transformer and FSDP2, and a raising rank
that fails the test instead of hanging it."""

import copy
import os
import random
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import torchmha
from helpers import finish_rank

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

TOLERANCES = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}
JOIN_TIMEOUT_S = 150  # a whole spawned run; collectives time out sooner (COLLECTIVE_TIMEOUT_S)
COLLECTIVE_TIMEOUT_S = 30


def _free_loopback_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, worker, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on the loopback interface
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        worker(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish_rank()


def _spawn(worker, world_size, *args):
    """Runs worker(rank, world_size, *args) in world_size processes. A rank that raises fails the
    test with its traceback (torch.multiprocessing terminates the others); a run that outlives
    JOIN_TIMEOUT_S is killed and fails the test."""
    context = mp.start_processes(
        _entry, args=(world_size, _free_loopback_port(), worker, args), nprocs=world_size, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{worker.__name__} on {world_size} processes did not finish in {JOIN_TIMEOUT_S} s")


def _close(actual, expected, dtype, what):
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype], msg=lambda m: f"{what}: {m}")


def _full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


# ---------------------------------------------------------------------------------------------
# Head parallel


def _head_parallel_configs(count):
    rng = random.Random(0)
    for i in range(count):
        yield dict(
            dtype=rng.choice([torch.float64, torch.float32]),
            batch_first=rng.random() < 0.5,
            heads=rng.choice([2, 4]),
            head_dim=rng.choice([2, 3]),
            separate=i % 4 == 3,  # kdim != embed_dim: q/k/v_proj_weight
            bias=rng.random() < 0.8,
            bias_kv=i % 5 == 4,
            batch=rng.choice([1, 3]),
            tgt=rng.randint(1, 6),
            src=rng.randint(1, 6),
            self_attention=rng.random() < 0.5,
            padding=rng.choice([None, "bool", "float"]),
            attn_mask=rng.choice([None, "2d", "3d"]),
            need_weights=rng.random() < 0.5,
            average=rng.random() < 0.5,
            causal=rng.random() < 0.3,
        )


def _head_parallel_parity(rank, world_size):
    for c in _head_parallel_configs(24):
        dtype, heads = c["dtype"], c["heads"]
        embed = heads * c["head_dim"]
        kdim = embed + 1 if c["separate"] else None
        if c["self_attention"] and not c["separate"]:
            c["src"] = c["tgt"]
        torch.manual_seed(1)
        reference = nn.MultiheadAttention(
            embed, heads, bias=c["bias"], add_bias_kv=c["bias_kv"], add_zero_attn=c["bias_kv"], kdim=kdim,
            vdim=kdim, batch_first=c["batch_first"], dtype=dtype,
        )
        module = torchmha.distributed.parallelize_heads(copy.deepcopy(reference))

        def shape(length, width):
            return (c["batch"], length, width) if c["batch_first"] else (length, c["batch"], width)

        query = torch.randn(shape(c["tgt"], embed), dtype=dtype, requires_grad=True)
        if c["self_attention"] and not c["separate"]:
            key = value = query
        else:
            key = torch.randn(shape(c["src"], kdim or embed), dtype=dtype, requires_grad=True)
            value = torch.randn(shape(c["src"], kdim or embed), dtype=dtype, requires_grad=True)
        src = c["src"]  # torch pads the masks itself for bias_k
        kwargs = {}
        if c["padding"]:
            padding = torch.rand(c["batch"], c["src"]) < 0.3
            padding[:, 0] = False
            kwargs["key_padding_mask"] = padding if c["padding"] == "bool" else padding.to(dtype) * -1e4
        if c["causal"] or c["attn_mask"] == "2d":
            mask = torch.triu(torch.ones(c["tgt"], src, dtype=torch.bool), 1 + src - c["tgt"])
            kwargs["attn_mask"] = mask if c["padding"] != "float" else mask.to(dtype) * -1e4
            kwargs["is_causal"] = c["causal"]
        elif c["attn_mask"] == "3d":
            kwargs["attn_mask"] = torch.randn(c["batch"] * heads, c["tgt"], src, dtype=dtype)
            if c["padding"] == "bool":
                kwargs["key_padding_mask"] = kwargs["key_padding_mask"].to(dtype) * -1e4
        kwargs.update(need_weights=c["need_weights"], average_attn_weights=c["average"])
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected, expected_weights = reference(query, key, value, **kwargs)
            actual, weights = module(query, key, value, **kwargs)
        what = f"rank {rank} config {c}"
        _close(actual, expected, dtype, f"output, {what}")
        if c["need_weights"]:
            _close(weights, expected_weights, dtype, f"weights, {what}")
        else:
            assert weights is None
        inputs = list({id(t): t for t in (query, key, value)}.values())
        target = torch.randn_like(expected)
        expected_grads = torch.autograd.grad((expected * target).sum(), inputs + list(reference.parameters()))
        grads = torch.autograd.grad((actual * target).sum(), inputs + list(module.parameters()))
        names = [f"input {i}" for i in range(len(inputs))] + [n for n, _ in reference.named_parameters()]
        for name, g, e in zip(names, grads, expected_grads):
            _close(_full(g), e, dtype, f"grad {name}, {what}")
        # state_dict: torch's names and shapes, and the full tensors load into torch's module.
        state = module.state_dict()
        assert list(state) == list(reference.state_dict()), what
        full = {k: _full(v) for k, v in state.items()}
        for name, tensor in reference.state_dict().items():
            assert torch.equal(full[name], tensor), f"state_dict {name}, {what}"


def test_head_parallel_matches_single_process():
    _spawn(_head_parallel_parity, 2)


def _head_parallel_products(rank, world_size):
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountProducts(TorchDispatchMode):
        products = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                       torch.ops.aten.baddbmm):
                self.products.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    module = torchmha.distributed.parallelize_heads(nn.MultiheadAttention(16, 4, batch_first=True)).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), CountProducts() as counter:
        module(x, x, x, need_weights=False)
    # This rank's in-projection (one packed GEMM for self-attention: the core projects the query
    # to its heads itself, given head_dim) and its out-projection: no identity product for q.
    assert len(counter.products) == 2 and counter.products[0] == "addmm", counter.products


def test_head_parallel_runs_two_products_per_layer():
    _spawn(_head_parallel_products, 2)


def _non_divisible(rank, world_size):
    module = torchmha.MultiheadAttention(6, 3)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be divisible by the number of ranks.*\(2\)"):
        torchmha.distributed.parallelize_heads(module)
    assert type(module) is torchmha.MultiheadAttention and not isinstance(module.in_proj_weight, torch.distributed.tensor.DTensor)


def test_head_parallel_rejects_heads_not_divisible_by_ranks():
    _spawn(_non_divisible, 2)


def _transformer(rank, world_size):
    torch.manual_seed(2)
    reference = nn.Transformer(
        d_model=8, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0,
        batch_first=True, dtype=torch.float64,
    )
    model = copy.deepcopy(reference)
    assert torchmha.replace_multihead_attention(model) == 3
    torchmha.distributed.parallelize_heads(model)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    assert kinds == {torchmha.distributed.HeadParallelMultiheadAttention}
    src = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    tgt = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    expected = reference(src, tgt, tgt_mask=mask, tgt_is_causal=True)
    actual = model(src, tgt, tgt_mask=mask, tgt_is_causal=True)
    _close(actual, expected, torch.float64, "nn.Transformer output")
    expected_grads = torch.autograd.grad(expected.square().sum(), [src, tgt, *reference.parameters()])
    grads = torch.autograd.grad(actual.square().sum(), [src, tgt, *model.parameters()])
    names = ["src", "tgt"] + [n for n, _ in reference.named_parameters()]
    for name, g, e in zip(names, grads, expected_grads):
        _close(_full(g), e, torch.float64, f"nn.Transformer grad {name}")


def test_head_parallel_transformer():
    _spawn(_transformer, 2)


def _checkpoint_reference():
    torch.manual_seed(3)
    return nn.MultiheadAttention(8, 4, batch_first=True, dtype=torch.float64)


def _save_head_parallel(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    module = torchmha.distributed.parallelize_heads(copy.deepcopy(_checkpoint_reference()))
    dcp.save(module.state_dict(), checkpoint_id=path, planner=torchmha.distributed.SavePlanner())


def _load_head_parallel(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    reference = _checkpoint_reference()
    torch.manual_seed(100)  # other weights, which the checkpoint must overwrite
    module = torchmha.distributed.parallelize_heads(nn.MultiheadAttention(8, 4, batch_first=True, dtype=torch.float64))
    state = module.state_dict()
    dcp.load(state, checkpoint_id=path, planner=torchmha.distributed.LoadPlanner())
    module.load_state_dict(state)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(_full(module.state_dict()[name]), tensor), f"rank {rank} of {world_size}: {name}"
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    _close(module(x, x, x)[0], reference(x, x, x)[0], torch.float64, f"output after loading on {world_size} ranks")
    # And into one process's torch module, without any planner of ours.
    if rank == 0:
        plain = nn.MultiheadAttention(8, 4, batch_first=True, dtype=torch.float64)
        plain_state = plain.state_dict()
        dcp.load(plain_state, checkpoint_id=path, no_dist=True)
        for name, tensor in reference.state_dict().items():
            assert torch.equal(plain_state[name], tensor), f"plain load: {name}"


def test_head_parallel_checkpoint_saves_on_2_and_loads_on_2_and_4():
    with tempfile.TemporaryDirectory() as path:
        _spawn(_save_head_parallel, 2, path)
        _spawn(_load_head_parallel, 2, path)
        _spawn(_load_head_parallel, 4, path)


def _fsdp2_with_head_parallel(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(4)
    reference = nn.TransformerEncoderLayer(8, 4, dim_feedforward=16, dropout=0.0, batch_first=True, dtype=torch.float64)
    with torch.no_grad():  # torch starts the attention biases at zero, which would hide a misplaced entry
        reference.self_attn.in_proj_bias.normal_()
        reference.self_attn.out_proj.bias.normal_()
    model = copy.deepcopy(reference)
    torchmha.distributed.parallelize_heads(model, mesh["tp"])
    # FSDP2 shards the packed projection's columns: its rows are already a strided shard over tp.
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=torchmha.distributed.fsdp_shard_placement)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, 8, dtype=torch.float64, generator=generator)
    target = torch.randn(4, 5, 8, dtype=torch.float64, generator=generator)
    # Data parallel over dp: each dp group takes half the batch; the loss is a mean over the batch.
    dp = mesh["dp"].get_local_rank()
    shard = slice(2 * dp, 2 * dp + 2)
    ((reference(x) - target) ** 2).mean().backward()
    ((model(x[shard]) - target[shard]) ** 2).mean().backward()
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(_full(actual.detach()), expected.detach()), f"rank {rank} value {name}"
        _close(_full(actual.grad), expected.grad, torch.float64, f"rank {rank} grad {name}")
    # state_dict: torch's names and shapes, and the full tensors are torch's.
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(_full(state[name]), tensor), f"rank {rank} state_dict {name}"


def test_head_parallel_with_fsdp2_on_a_2x2_mesh():
    _spawn(_fsdp2_with_head_parallel, 4)


# ---------------------------------------------------------------------------------------------
# Context parallel


def _context_parallel_parity(rank, world_size, count):
    rng = random.Random(10 + world_size)
    for i in range(count):
        dtype = rng.choice([torch.float64, torch.float32])
        heads = rng.choice([1, 2, 4])
        embed = heads * rng.choice([2, 4])
        causal = i % 2 == 1
        local = rng.choice([2, 4, 6]) if causal else rng.randint(1, 5)
        batch = rng.choice([1, 2])
        padding_kind = rng.choice([None, "bool", "float"])
        torch.manual_seed(20 + i)
        reference = nn.MultiheadAttention(embed, heads, bias=rng.random() < 0.8, batch_first=True, dtype=dtype)
        module = torchmha.distributed.ContextParallelAttention(copy.deepcopy(reference))
        length = local * world_size
        x = torch.randn(batch, length, embed, dtype=dtype, requires_grad=True)
        padding = None
        if padding_kind:
            padding = torch.rand(batch, length) < 0.3
            padding[:, 0] = False  # every query keeps a key (causal: key 0)
            if padding_kind == "float":
                padding = padding.to(dtype) * -1e4 + torch.rand(batch, length, dtype=dtype)
        mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=dtype) if causal else None
        if causal and padding_kind == "bool":
            mask = mask.isinf()
        expected = reference(x, x, x, key_padding_mask=padding, attn_mask=mask, need_weights=False, is_causal=causal)[0]
        rows = slice(rank * local, (rank + 1) * local)
        x_local = x.detach()[:, rows].clone().requires_grad_()
        actual = module(x_local, key_padding_mask=None if padding is None else padding[:, rows], is_causal=causal)
        what = f"rank {rank}/{world_size} config {i}: {dtype}, heads {heads}, E {embed}, L {length}, N {batch}, causal {causal}, padding {padding_kind}"
        _close(actual, expected[:, rows], dtype, f"output, {what}")
        with torch.no_grad():  # inference reuses the local K/V buffers for the ring (P > 2)
            inferred = module(x_local, key_padding_mask=None if padding is None else padding[:, rows], is_causal=causal)
        _close(inferred, expected[:, rows], dtype, f"output without gradients, {what}")
        target = torch.randn_like(expected)
        expected_grads = torch.autograd.grad((expected * target).sum(), [x, *reference.parameters()])
        grads = torch.autograd.grad((actual * target[:, rows]).sum(), [x_local, *module.parameters()])
        _close(grads[0], expected_grads[0][:, rows], dtype, f"grad x, {what}")
        for (name, _), g, e in zip(reference.named_parameters(), grads[1:], expected_grads[1:]):
            g = g.contiguous()
            dist.all_reduce(g)  # each rank's part of the parameter gradient
            _close(g, e, dtype, f"grad {name}, {what}")


def test_context_parallel_matches_single_process_on_2():
    _spawn(_context_parallel_parity, 2, 16)


def test_context_parallel_matches_single_process_on_4():
    _spawn(_context_parallel_parity, 4, 8)


def _bad_input(rank, world_size):
    module = torchmha.distributed.ContextParallelAttention(nn.MultiheadAttention(4, 2, batch_first=True))
    with pytest.raises(ValueError, match=r"same batch size and slice length L/P on every rank.*\(1, 3\).*\(1, 2\)"):
        module(torch.randn(1, 3 - rank, 4))
    with pytest.raises(ValueError, match=r"L/P must be even"):
        module(torch.randn(1, 3, 4), is_causal=True)


def test_context_parallel_rejects_bad_slices():
    _spawn(_bad_input, 2)


def _one_rank_raises(rank, world_size):
    module = torchmha.distributed.ContextParallelAttention(nn.MultiheadAttention(4, 2, batch_first=True))
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    module(torch.randn(1, 2, 4))  # rank 0 waits in the ring for rank 1, which never comes


def test_a_raising_rank_fails_the_test_instead_of_hanging():
    start = time.monotonic()
    # Whichever rank exits first is reported: rank 1's own error, or rank 0's collective failing
    # because its peer is gone (gloo notices the closed connection; otherwise the 30 s timeout).
    with pytest.raises(Exception, match="rank 1 fails on purpose|Connection closed by peer|timed out|Timed out"):
        _spawn(_one_rank_raises, 2)
    assert time.monotonic() - start < JOIN_TIMEOUT_S
