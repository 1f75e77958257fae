"""CachedDecoder(model, weight_dtype=torch.int8) (python/torchmha/cached_decoder.py, csrc/core/cached_decoder.cpp,
csrc/core/small_linear.cpp): the layers' linear weights read as int8 copies with a scale per output channel. A step
equals the float step of the same model with those int8 weights dequantized, in every dtype; the model's own
parameters stay as they are; a weight that changes is quantized again; bad input is refused."""

import copy

import pytest
import torch
from torch import nn

import torchmha
from helpers import assert_close
from test_cached_decoder import CONFIGS, E, FF, S, Generation, make_model, reference

ops = torch.ops.torchmha
LINEAR_WEIGHTS = ("in_proj_weight", "out_proj.weight", "linear1.weight", "linear2.weight")



def dequantized(model, dtype=None):
    """A copy of `model` (in `dtype`) whose linear weights are the int8 weights CachedDecoder reads,
    dequantized: the float model the int8 step must equal."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(LINEAR_WEIGHTS):
                q, scale = ops.quantize_weight(p)
                p.copy_(q.double() * scale.double()[:, None])
    return ref if dtype is None else ref.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS[:6], ids=lambda c: "-".join(f"{k}={getattr(v, '__name__', v)}"
                                                                         for k, v in c.items()))
def test_int8_steps_equal_the_dequantized_model(config, dtype):
    """Prefill with mixed lengths, then steps (the kernel's rows and the reference's), against the
    dequantized model's full forward; decoders' memory is projected through the int8 weights too."""
    model = make_model(dtype=dtype, **config)
    g = Generation(model, N=3, max_length=12, dtype=dtype, memory_mask=True, weight_dtype=torch.int8)
    g.step([5, 3, 4])
    for _ in range(3):
        g.step([1, 1, 1])
    g.step([2, 1, 2])
    g.model = dequantized(model)
    g.check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_int8_within_torchs_own_error(dtype):
    """In bfloat16/float16, against float64 with the same int8 weights: within twice the error of
    torch's own forward in the dtype on the dequantized weights."""
    model64 = make_model("decoder", norm_first=True)
    model = copy.deepcopy(model64).to(dtype)
    g = Generation(model, N=2, max_length=8, dtype=dtype, weight_dtype=torch.int8)
    g.step([3, 2])
    g.step([1, 1])
    exact_model, torch_model = dequantized(model), dequantized(model, dtype)
    exact_model.double()
    for n in range(2):
        got = torch.cat(g.outputs[n]).double()
        tokens, memory = g.tokens[n][:g.filled[n]], g.memory[n]
        exact = reference(exact_model, tokens.double(), memory.double())
        torch_own = reference(torch_model, tokens, memory).double()
        assert (got - exact).abs().max() <= 2 * (torch_own - exact).abs().max() + 1e-2


def test_the_model_keeps_its_parameters_and_int8_differs_from_float():
    model = make_model("decoder", dtype=torch.float32)
    before = copy.deepcopy(model.state_dict())
    dec = torchmha.CachedDecoder(model, weight_dtype=torch.int8)
    x, memory = torch.randn(4, 1, E), torch.randn(S, 1, E)
    y = dec(x, dec.new_state(1, 4, memory=memory))
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]) and t.dtype == before[name].dtype, name
    exact = reference(model, x[:, 0], memory[:, 0])
    # the quantization shows (not the float weights read by mistake), and stays small
    assert 1e-5 < (y[:, 0] - exact).abs().max() < 0.05 * exact.abs().max()


def optimizer_step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.3)
    optimizer.step()


def changes(model):
    """Ways a model's weights change after the CachedDecoder was made (each bumps a version
    counter, replaces a Parameter or its storage: what autograd tracks too)."""
    layer = model.layers[1]
    return {
        "optimizer step": lambda: optimizer_step(model),
        "load_state_dict": lambda: model.load_state_dict(make_model("decoder", seed=3).state_dict()),
        "a new Parameter": lambda: setattr(layer.linear2, "weight", nn.Parameter(layer.linear2.weight.detach() * 2)),
        "in place on one weight": lambda: layer.self_attn.in_proj_weight.detach().mul_(1.5),
    }


@pytest.mark.parametrize("change", list(changes(make_model("decoder"))))
def test_a_changed_weight_is_quantized_again(change):
    """Never stale weights: the step after a change equals the changed model's dequantized forward."""
    model = make_model("decoder")
    dec = torchmha.CachedDecoder(model, weight_dtype=torch.int8)
    x, memory = torch.randn(4, 1, E, dtype=torch.float64), torch.randn(S, 1, E, dtype=torch.float64)
    before = dec(x, dec.new_state(1, 4, memory=memory))
    changes(model)[change]()
    after = dec(x, dec.new_state(1, 4, memory=memory))
    assert (after - before).abs().max() > 1e-3
    assert_close(after[:, 0], reference(dequantized(model), x[:, 0], memory[:, 0]))


def test_a_model_cast_after_construction_is_served_in_its_new_dtype():
    model = make_model("decoder")
    dec = torchmha.CachedDecoder(model, weight_dtype=torch.int8)
    first = dec._int8
    model.float()
    x, memory = torch.randn(3, 1, E), torch.randn(S, 1, E)
    y = dec(x, dec.new_state(1, 4, memory=memory))
    assert dec._int8 is not first and y.dtype == torch.float32
    assert_close(y[:, 0], reference(dequantized(model), x[:, 0], memory[:, 0]))


def test_refresh_quantizes_now():
    """A write through .data, which no version counter sees (autograd does not either), needs refresh()."""
    model = make_model("encoder")
    dec = torchmha.CachedDecoder(model, weight_dtype=torch.int8)
    old = dec._int8.weights[8]
    model.layers[0].linear1.weight.data.mul_(-1)
    dec.refresh()
    assert torch.equal(dec._int8.weights[8], -old)


def test_a_model_made_under_inference_mode():
    """Inference tensors keep no version counter (reading one raises): the decoder is made with a
    warning that an in-place change needs refresh(), steps equal the dequantized model, and a
    replaced weight is still seen."""
    with torch.inference_mode():
        model = make_model("decoder", dtype=torch.float32)
    with pytest.warns(UserWarning, match="inference tensors .* call refresh"):
        g = Generation(model, N=2, max_length=6, dtype=torch.float32, weight_dtype=torch.int8)
    with torch.inference_mode():
        g.step([2, 3])
        g.step([1, 1])
    g.model = dequantized(model)
    g.check()
    with torch.inference_mode(), pytest.warns(UserWarning, match="inference tensors"):
        model.layers[0].linear1.weight = nn.Parameter(-model.layers[0].linear1.weight)
        g.dec._step_params()


def test_a_failed_int8_step_leaves_the_state():
    g = Generation(make_model("decoder"), N=2, max_length=6, dtype=torch.float64, weight_dtype=torch.int8)
    g.step([2, 1])
    lengths = g.state.lengths.clone()
    with pytest.raises(ValueError, match="d_model is 16"):
        g.dec(torch.randn(1, 2, E + 1, dtype=torch.float64), g.state)
    assert torch.equal(g.state.lengths, lengths)
    g.step([1, 1])
    g.model = dequantized(g.model)
    g.check()


def test_other_weight_dtypes_and_training_are_refused():
    model = make_model("encoder")
    with pytest.raises(ValueError, match="weight_dtype must be None .* or torch.int8, not torch.float16"):
        torchmha.CachedDecoder(model, weight_dtype=torch.float16)
    dec = torchmha.CachedDecoder(model.train(), weight_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        dec(torch.randn(1, 1, E, dtype=torch.float64), dec.new_state(1, 4))


def op_arguments(dec, state, x):
    params, scales = dec._step_params()
    return [x, params, *state._cache(), dec.num_heads, dec._activations, dec._norm_first, dec._eps, dec._final_eps,
            dec.batch_first, False, None, scales]


@pytest.mark.parametrize("tamper, match", [
    (lambda params, scales: scales.__setitem__(8, None), "layer 0's linear1.weight: an int8 weight needs its scale"),
    (lambda params, scales: scales.__setitem__(9, torch.ones(FF)), "parameter 9 is not a linear weight"),
    (lambda params, scales: scales.__setitem__(2, torch.ones(3)), r"out_proj.weight: expected a float32 scale of "
                                                                 r"shape \(16,\)"),
    (lambda params, scales: scales.pop(), "a weight scale per parameter"),
])
def test_the_op_refuses_scales_that_do_not_fit(tamper, match):
    model = make_model("encoder")
    dec = torchmha.CachedDecoder(model, weight_dtype=torch.int8)
    state = dec.new_state(1, 4)
    args = op_arguments(dec, state, torch.randn(1, 1, E, dtype=torch.float64))
    args[1], args[-1] = list(args[1]), list(args[-1])
    tamper(args[1], args[-1])
    with pytest.raises(ValueError, match=match):
        ops.decoder_step(*args)
    assert state.lengths.tolist() == [0]



def test_off_the_cpu_kernel_the_reference_computes_the_same():
    """TORCHMHA_SMALL_LINEAR=0 (as on a device without the kernel): the dequantizing reference."""
    from helpers import run_python_with
    import pathlib
    code = ("import sys; sys.path.insert(0, %r); import test_cached_decoder_int8 as t; "
            "t.test_int8_steps_equal_the_dequantized_model(t.CONFIGS[0], t.torch.float32)")
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_SMALL_LINEAR": "0"})


def test_compiled_int8_step_and_refresh():
    """fullgraph: no graph break; after refresh() the compiled step serves the new weights."""
    torch._dynamo.reset()
    model = make_model("decoder", dtype=torch.float32)
    dec = torchmha.CachedDecoder(model, weight_dtype=torch.int8)
    memory = torch.randn(S, 2, E)
    compiled = torch.compile(dec, backend="aot_eager", fullgraph=True)
    for change in (False, True):
        if change:
            optimizer_step(model)
            dec.refresh()
        eager_state, compiled_state = dec.new_state(2, 6, memory=memory), dec.new_state(2, 6, memory=memory)
        with torch.no_grad():
            for T in (3, 1, 1):
                x = torch.randn(T, 2, E)
                assert_close(compiled(x, compiled_state), dec(x, eager_state), torch.float32)
