"""PyTorch's own sample inputs, from the torch wheel's test database, run through torch and
through torchmha swapped in: the ModuleInfo entries of nn.MultiheadAttention and of the
Transformer layers that contain it (module_db), and the OpInfo samples of
nn.functional.multi_head_attention_forward (op_db). Outputs and gradients (inputs and parameters)
must be equal."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_modules import module_db

import torchmha

MODULES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer,
           torch.nn.Transformer)
MODULE_INFOS = [info for info in module_db if info.module_cls in MODULES]
OP_INFOS = [info for info in op_db if info.name == "nn.functional.multi_head_attention_forward"]
DTYPE = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def test_torchs_database_has_the_entries():
    assert {info.module_cls for info in MODULE_INFOS} == set(MODULES)
    assert OP_INFOS


def tensors_of(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return []


def detached_copy(value):
    """Inputs for one run: fresh leaves, so each side gets its own gradients."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(detached_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: detached_copy(v) for k, v in value.items()}
    return value


def run_with_gradients(fn, args, kwargs, parameters):
    """Outputs, then the gradients of the inputs and parameters for a fixed random cotangent."""
    args, kwargs = detached_copy(args), detached_copy(kwargs)
    outputs = [t for t in tensors_of(fn(*args, **kwargs)) if t is not None]
    leaves = [t for t in tensors_of((args, kwargs)) if t.requires_grad] + list(parameters)
    differentiable = [o for o in outputs if o.requires_grad]
    if not differentiable or not leaves:
        return outputs, []
    generator = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, dtype=o.dtype, generator=generator)).sum() for o in differentiable)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return outputs, list(grads)


def assert_all_close(ours, theirs, what):
    assert len(ours) == len(theirs), what
    for a, b in zip(ours, theirs):
        if b is None:
            assert a is None or not a.any(), what
            continue
        assert a.shape == b.shape, what
        torch.testing.assert_close(a, b, equal_nan=True, msg=what, **TOL)


def module_samples():
    for info in MODULE_INFOS:
        for training in (True, False):
            samples = info.module_inputs_func(info, device="cpu", dtype=DTYPE, requires_grad=True, training=training)
            for index, sample in enumerate(samples):
                # (the whole nn.Transformer's samples take most of the time: make test runs them, make check not)
                marks = [pytest.mark.slow] if info.module_cls is torch.nn.Transformer else []
                yield pytest.param(info, training, index, marks=marks,
                                   id=f"{info.name}-{'train' if training else 'eval'}-{index}")


def swapped(module):
    """The same module (same weights) with every torch MultiheadAttention made torchmha's."""
    ours = copy.deepcopy(module)
    assert torchmha.replace_multihead_attention(ours) > 0
    return ours


def dropout_is_drawn(module, training):
    return training and any(
        (isinstance(m, torch.nn.Dropout) and m.p > 0) or (isinstance(m, torch.nn.MultiheadAttention) and m.dropout > 0)
        for m in module.modules())


@pytest.mark.parametrize("info, training, index", list(module_samples()))
def test_module_db_sample_like_torch(info, training, index):
    sample = info.module_inputs_func(info, device="cpu", dtype=DTYPE, requires_grad=True, training=training)[index]
    ctor, fwd = sample.constructor_input, sample.forward_input
    torch.manual_seed(0)
    theirs = info.module_cls(*ctor.args, **ctor.kwargs).to(DTYPE).train(training)
    ours = swapped(theirs)
    if dropout_is_drawn(theirs, training):
        pytest.skip("dropout draws its mask in another order (not comparable elementwise)")
    expected = run_with_gradients(theirs, fwd.args, fwd.kwargs, theirs.parameters())
    got = run_with_gradients(ours, fwd.args, fwd.kwargs, ours.parameters())
    assert_all_close(got[0], expected[0], "outputs")
    assert_all_close(got[1], expected[1], "gradients")


@pytest.mark.parametrize("info", OP_INFOS, ids=lambda info: info.name)
def test_op_db_samples_like_torch(info):
    samples = list(info.sample_inputs("cpu", DTYPE, requires_grad=True))
    assert samples
    for sample in samples:
        args, kwargs = (sample.input, *sample.args), sample.kwargs
        if kwargs.get("training") and kwargs.get("dropout_p", args[10] if len(args) > 10 else 0) > 0:
            continue  # dropout: a random mask in another order
        expected = run_with_gradients(F.multi_head_attention_forward, args, kwargs, [])
        got = run_with_gradients(torchmha.functional.multi_head_attention_forward, args, kwargs, [])
        assert_all_close(got[0], expected[0], f"outputs of {sample}")
        assert_all_close(got[1], expected[1], f"gradients of {sample}")
