"""torchmha.CachedDecoder (python/torchmha/cached_decoder.py, csrc/core/cached_decoder.cpp): cached
generation through torch's own Transformer models equals the model's causal forward over each
sequence's own prefix, whatever the schedule (prefill with mixed lengths, chunks, single steps,
beam reorders, slot resets), and bad input leaves the state as it was."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchmha
from helpers import assert_close

E, H, FF, LAYERS, S = 16, 4, 24, 2, 5


def randomize(model, seed=0):
    """Every parameter random (norm weights around 1), so no bias or norm can be dropped unseen."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            p.copy_(1 + 0.2 * noise if "norm" in name and name.endswith("weight") else 0.3 * noise)
    return model.eval()


def make_model(kind="decoder", *, norm_first=False, activation="relu", bias=True, batch_first=False, eps=1e-5,
               final_norm=True, dtype=torch.float64, seed=0):
    if isinstance(activation, nn.Module):
        activation = copy.deepcopy(activation).to(dtype)
    layer_args = dict(dim_feedforward=FF, dropout=0.1, activation=activation, layer_norm_eps=eps,
                      batch_first=batch_first, norm_first=norm_first, bias=bias, dtype=dtype)
    norm = nn.LayerNorm(E, eps=eps, bias=bias, dtype=dtype) if final_norm else None
    if kind == "transformer":
        model = nn.Transformer(E, H, num_encoder_layers=1, num_decoder_layers=LAYERS, custom_decoder=None,
                               **layer_args)
    elif kind == "decoder":
        model = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **layer_args), LAYERS, norm=norm)
    else:
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **layer_args), LAYERS, norm=norm,
                                      enable_nested_tensor=False)
    return randomize(model, seed)


def is_decoder(model):
    return not isinstance(model, nn.TransformerEncoder)


def reference(model, tokens, memory=None, memory_mask=None, batch_first=False):
    """The model's causal forward over one sequence: tokens (L, E), memory (S, E) -> (L, E)."""
    L = tokens.shape[0]
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=tokens.dtype)
    x = tokens.unsqueeze(0 if batch_first else 1)
    stack = model.decoder if isinstance(model, nn.Transformer) else model
    with torch.no_grad():
        if is_decoder(model):
            m = memory.unsqueeze(0 if batch_first else 1)
            pad = None if memory_mask is None else memory_mask.unsqueeze(0)
            y = stack(x, m, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
        else:
            y = stack(x, mask=causal, is_causal=True)
    return y.squeeze(0 if batch_first else 1)


class Generation:
    """Drives a CachedDecoder over N sequences of known tokens, keeping each sequence's outputs,
    and checks them against the model's forward over each sequence's own prefix."""

    def __init__(self, model, N, max_length, dtype, memory_len=S, memory_mask=False, seed=0, weight_dtype=None):
        gen = torch.Generator().manual_seed(seed)
        self.model, self.dtype = model, dtype
        self.batch_first = CachedDecoderBatchFirst(model)
        self.dec = torchmha.CachedDecoder(model, weight_dtype=weight_dtype)
        self.tokens = [torch.randn(max_length, E, generator=gen, dtype=torch.float64).to(dtype) for _ in range(N)]
        self.memory = [torch.randn(memory_len, E, generator=gen, dtype=torch.float64).to(dtype) for _ in range(N)]
        self.memory_mask = None
        if memory_mask:
            self.memory_mask = torch.rand(N, memory_len, generator=gen) < 0.3
            self.memory_mask[:, 0] = False
        self.filled = [0] * N
        self.outputs = [[] for _ in range(N)]
        memory = self.layout(torch.stack(self.memory)) if is_decoder(model) else None
        self.state = self.dec.new_state(N, max_length, memory=memory, memory_key_padding_mask=self.memory_mask)

    def layout(self, batch):  # (N, L, E) -> the model's layout
        return batch if self.batch_first else batch.transpose(0, 1)

    def step(self, counts):
        """Sequence n appends its next counts[n] tokens (new_lengths when they differ)."""
        T = max(counts)
        rows = []
        for n, c in enumerate(counts):
            mine = self.tokens[n][self.filled[n]:self.filled[n] + c]
            junk = torch.randn(T - c, E, dtype=self.dtype) * 100  # rows past new_lengths: must leave no trace
            rows.append(torch.cat([mine, junk]))
        uniform = len(set(counts)) == 1
        new_lengths = None if uniform else torch.tensor(counts)
        y = self.layout_back(self.dec(self.layout(torch.stack(rows)), self.state, new_lengths))
        for n, c in enumerate(counts):
            self.outputs[n].append(y[n, :c])
            assert (y[n, c:] == 0).all(), "rows past new_lengths must be zeros"
            self.filled[n] += c
        assert self.state.lengths.tolist() == self.filled

    def layout_back(self, y):
        return y if self.batch_first else y.transpose(0, 1)

    def check(self, dtype=None):
        for n in range(len(self.tokens)):
            got = torch.cat(self.outputs[n])
            mask = None if self.memory_mask is None else self.memory_mask[n]
            expected = reference(self.model, self.tokens[n][:self.filled[n]], self.memory[n], mask, self.batch_first)
            assert_close(got, expected, dtype or self.dtype, msg=f"sequence {n}")


def CachedDecoderBatchFirst(model):
    stack = model.decoder if isinstance(model, nn.Transformer) else model
    return stack.layers[0].self_attn.batch_first


CONFIGS = [
    dict(kind="decoder"),
    dict(kind="decoder", norm_first=True, activation="gelu", batch_first=True),
    dict(kind="transformer", activation=F.silu, eps=1e-3),
    dict(kind="decoder", bias=False, final_norm=False, activation=nn.GELU(approximate="tanh")),
    dict(kind="encoder"),
    dict(kind="encoder", norm_first=True, batch_first=True, activation=nn.ReLU(), final_norm=False),
    dict(kind="encoder", bias=False, activation="gelu", eps=1e-6),
    dict(kind="decoder", activation=torch.tanh),                       # callables the step calls back
    dict(kind="encoder", norm_first=True, activation=nn.PReLU(dtype=torch.float64)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in c.items()))
def test_prefill_chunks_and_steps_equal_the_full_forward(config, dtype):
    g = Generation(make_model(dtype=dtype, **config), N=3, max_length=12, dtype=dtype, memory_mask=True)
    g.step([4, 1, 3])  # prefill, prompts of different lengths (new_lengths)
    g.step([2, 2, 2])  # a chunk
    g.step([1, 1, 1])  # single steps
    g.step([0, 3, 1])  # a sequence that adds nothing
    g.step([1, 1, 1])
    g.check()


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules(seed):
    rng = random.Random(seed)
    config = rng.choice(CONFIGS)
    g = Generation(make_model(dtype=torch.float64, seed=seed, **config), N=rng.randint(1, 4), max_length=16,
                   dtype=torch.float64, memory_mask=rng.random() < 0.5, seed=seed)
    while True:
        counts = [rng.randint(0, 3) for _ in g.tokens]
        if max(counts) == 0 or any(f + c > 16 for f, c in zip(g.filled, counts)):
            break
        g.step(counts)
    g.check()


def test_a_callable_activation_reads_its_live_parameters():
    model = make_model("encoder", activation=nn.PReLU(init=0.5, dtype=torch.float64))
    g = Generation(model, N=2, max_length=8, dtype=torch.float64)
    g.step([3, 2])
    with torch.no_grad():
        for layer in model.layers:
            layer.activation.weight.fill_(-2.0)
    g.state.reset()
    g.filled, g.outputs = [0, 0], [[], []]
    g.step([2, 3])
    g.check()


def test_torchmha_attention_in_the_layers():
    model = make_model("transformer")
    torchmha.replace_multihead_attention(model)
    g = Generation(model, N=2, max_length=6, dtype=torch.float64)
    g.step([3, 2])
    g.step([1, 1])
    g.check()


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_reorder_follows_caches_memory_and_mask(kind):
    g = Generation(make_model(kind), N=3, max_length=10, dtype=torch.float64, memory_mask=True)
    g.step([3, 2, 1])
    indices = [2, 0, 0]
    g.state.reorder(torch.tensor(indices))
    g.tokens = [g.tokens[i].clone() for i in indices]
    g.memory = [g.memory[i] for i in indices]
    g.memory_mask = g.memory_mask[indices]
    g.outputs = [list(g.outputs[i]) for i in indices]
    g.filled = [g.filled[i] for i in indices]
    assert g.state.lengths.tolist() == g.filled
    g.step([1, 2, 1])
    g.check()


def test_reorder_moves_only_the_filled_prefix():
    """Its cost follows what is filled, not max_length: positions past the longest sequence are
    not copied (they hold nothing any sequence reads)."""
    g = Generation(make_model("decoder"), N=3, max_length=10, dtype=torch.float64)
    g.step([3, 2, 1])
    g.state.keys[:, :, :, 3:] = torch.arange(3, dtype=torch.float64).view(1, 3, 1, 1, 1)  # row n's unfilled part: n
    g.state.reorder(torch.tensor([2, 0, 0]))
    assert (g.state.keys[:, :, :, 3:] == torch.arange(3, dtype=torch.float64).view(1, 3, 1, 1, 1)).all()


def test_reset_rejects_a_memory_that_does_not_fit_the_state():
    """The op itself (the shells pass decoder_memory's output): the new memory's shape against
    the state and the slots, named in the error."""
    g = Generation(make_model("decoder"), N=2, max_length=4, dtype=torch.float64)
    keys, values, padding = g.dec._project_memory(torch.randn(S, 1, E, dtype=torch.float64), None)
    state = g.state
    reset = torch.ops.torchmha.decoder_reset
    with pytest.raises(ValueError, match=r"reset expected the new memory's keys and values of shape \(2, 2 slots"):
        reset(*state._cache(), None, keys, values, padding)
    with pytest.raises(ValueError, match="reset expected the new memory's keys and values"):
        reset(*state._cache(), torch.tensor([0]), keys, None, padding)
    with pytest.raises(ValueError, match=r"reset expected the new memory's padding of shape \(1, 5\)"):
        reset(*state._cache(), torch.tensor([0]), keys, values, padding[:, :2])


@pytest.mark.parametrize("slots", [1, [1], torch.tensor([1]), torch.tensor([False, True, False]), (1,)])
def test_reset_with_a_new_shorter_memory(slots):
    model = make_model("decoder")
    g = Generation(model, N=3, max_length=10, dtype=torch.float64, memory_mask=True)
    g.step([2, 3, 1])
    new_memory = torch.randn(S - 2, E, dtype=torch.float64)
    new_mask = torch.tensor([[False, True, False]])
    g.state.reset(slots, memory=g.layout(new_memory.unsqueeze(0)), memory_key_padding_mask=new_mask)
    g.memory[1] = new_memory
    mask = g.memory_mask.clone()
    mask[1] = True
    mask[1, :S - 2] = new_mask[0]
    g.memory_mask = mask  # the reference masks the positions past the new memory as well
    g.memory[1] = torch.cat([new_memory, torch.zeros(2, E, dtype=torch.float64)])
    g.filled[1], g.outputs[1] = 0, []
    assert g.state.lengths.tolist() == g.filled
    g.step([1, 2, 1])
    g.step([1, 1, 1])
    g.check()


def test_reset_without_memory_keeps_the_slots_memory():
    g = Generation(make_model("transformer"), N=2, max_length=8, dtype=torch.float64)
    g.step([3, 2])
    g.state.reset([0])
    g.filled[0], g.outputs[0] = 0, []
    g.step([2, 1])
    g.check()
    g.state.reset()
    assert g.state.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("slots", [0, [0, 2], torch.tensor([0, 2]), torch.tensor([True, False, True])])
def test_key_value_cache_reset_takes_torch_index_forms(slots):
    cache = torchmha.KeyValueCache(3, 2, 4, 8)
    cache.lengths.fill_(3)
    cache.reset(slots=slots)
    expected = torch.full((3,), 3)
    expected[torch.as_tensor(slots)] = 0
    assert cache.lengths.tolist() == expected.tolist()


def test_every_step_reads_the_live_parameters():
    model = make_model("decoder")
    dec = torchmha.CachedDecoder(model)
    memory = torch.randn(S, 1, E, dtype=torch.float64)
    x = torch.randn(4, 1, E, dtype=torch.float64)
    before = dec(x, dec.new_state(1, 4, memory=memory))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    causal = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    model(x, memory, tgt_mask=causal).square().sum().backward()  # a training step between two calls
    optimizer.step()
    model.layers[1].linear2.weight = nn.Parameter(model.layers[1].linear2.weight.detach() * 2)  # a new Parameter
    model.eval()
    after = dec(x, dec.new_state(1, 4, memory=memory))
    assert (after - before).abs().max() > 1e-3
    assert_close(after[:, 0], reference(model, x[:, 0], memory[:, 0]))


@pytest.mark.parametrize("change", ["submodule", "out_proj", "functional_call"])
def test_a_step_reads_a_replaced_submodule_or_swapped_parameters(change):
    """Each step reads the modules as they are now: a submodule replaced since construction
    (setattr), or the tensors torch.func.functional_call writes into _parameters for its call."""
    model = make_model("decoder")
    dec = torchmha.CachedDecoder(model)
    memory = torch.randn(S, 1, E, dtype=torch.float64)
    x = torch.randn(3, 1, E, dtype=torch.float64)
    before = dec(x, dec.new_state(1, 3, memory=memory))
    if change == "functional_call":
        swapped = {name: p.detach() * 1.5 for name, p in dec.named_parameters() if name.endswith("linear1.weight")}
        after = torch.func.functional_call(dec, swapped, (x, dec.new_state(1, 3, memory=memory)))
        assert_close(dec(x, dec.new_state(1, 3, memory=memory)), before)  # the model's own again
        for name, p in swapped.items():
            dict(model.named_parameters())[name.removeprefix("model.")].data.copy_(p)  # the reference's model
    else:
        layer = model.layers[1]
        parent, name = (layer, "linear2") if change == "submodule" else (layer.multihead_attn, "out_proj")
        new = nn.Linear(*reversed(getattr(parent, name).weight.shape), dtype=torch.float64)
        setattr(parent, name, randomize(new, seed=1))
        after = dec(x, dec.new_state(1, 3, memory=memory))
    assert (after - before).abs().max() > 1e-3
    assert_close(after[:, 0], reference(model, x[:, 0], memory[:, 0]))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(mode):
    model = make_model("encoder", dtype=torch.float32)
    with mode():
        g = Generation(model, N=2, max_length=6, dtype=torch.float32)
        g.step([2, 3])
        g.step([1, 1])
    g.check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_torchs_own_error(dtype):
    model64 = make_model("decoder", norm_first=True)
    model = copy.deepcopy(model64).to(dtype)
    g = Generation(model, N=2, max_length=8, dtype=dtype)
    g.step([3, 2])
    g.step([1, 1])
    for n in range(2):
        got = torch.cat(g.outputs[n]).double()
        tokens = g.tokens[n][:g.filled[n]]
        exact = reference(model64, tokens.double(), g.memory[n].double())
        torch_own = reference(model, tokens, g.memory[n]).double()
        assert (got - exact).abs().max() <= 2 * (torch_own - exact).abs().max() + 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [dict(kind="decoder"), dict(kind="encoder", bias=False)], ids=["decoder", "no-bias"])
def test_post_norm_steps_without_gradients_within_torchs_own_error(dtype, config):
    """Inference steps of a post-norm stack, where each residual's LayerNorm is torchmha's one-pass
    kernel (residual_norm_kernel.cpp), with and without the norms' bias: against float64 within
    twice the error of torch's own forward in the dtype."""
    model64 = make_model(**config)
    model = copy.deepcopy(model64).to(dtype)
    with torch.inference_mode():
        g = Generation(model, N=2, max_length=8, dtype=dtype)
        g.step([3, 2])
        g.step([1, 1])
        g.step([1, 1])
    for n in range(2):
        got = torch.cat(g.outputs[n]).double()
        tokens = g.tokens[n][:g.filled[n]]
        memory = g.memory[n] if config["kind"] == "decoder" else None
        exact = reference(model64, tokens.double(), None if memory is None else memory.double())
        torch_own = (reference(model, tokens, memory).double() - exact).abs().max()
        slack = 1e-5 if dtype == torch.float32 else 0
        assert (got - exact).abs().max() <= 2 * torch_own + slack


KERNEL_OPS = ("torchmha::small_linear", "torchmha::quantized_linear", "torchmha::decode_attention",
              "torchmha::static_attention")


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                                 (torch.float32, torch.int8), (torch.bfloat16, torch.int8)],
                         ids=["float32", "bfloat16", "float16", "int8", "bfloat16-int8"])
@pytest.mark.parametrize("kind, batch_first, N, activation, norm_first", [
    ("decoder", False, 3, "relu", False), ("transformer", True, 8, "gelu", False), ("encoder", False, 1, F.silu, False),
    ("decoder", True, 2, "gelu", True), ("encoder", False, 4, "relu", True)])
def test_the_kernel_step_equals_the_composition_bit_for_bit(dtype, weight_dtype, kind, batch_first, N, activation,
                                                            norm_first):
    """One new position per sequence on the CPU: the kernel step (csrc/core/stack_kernel_step.cpp)
    calls the kernels directly, into buffers made once a step, and no op of theirs. A step with
    new_lengths, which it leaves to the composition (layer_step), runs the same kernels through
    their ops: the outputs and both caches are the same bit for bit, step after step."""
    model = make_model(kind, batch_first=batch_first, activation=activation, norm_first=norm_first, dtype=dtype)
    dec = torchmha.CachedDecoder(model, weight_dtype=weight_dtype)
    gen = torch.Generator().manual_seed(1)

    def rows(T):  # (N, T, E) in the model's layout
        x = torch.randn(N, T, E, generator=gen).to(dtype)
        return x if batch_first else x.transpose(0, 1)
    memory = rows(S) if is_decoder(model) else None
    mask = torch.arange(S).expand(N, S) >= torch.arange(S, S - N, -1).clamp(min=2).unsqueeze(1)  # some padded
    states = [dec.new_state(N, 8, memory, mask if memory is not None else None) for _ in range(2)]
    with torch.inference_mode():
        for T in (3, 1, 1, 1):
            x = rows(T)
            with torch.profiler.profile() as prof:
                kernel = dec(x, states[0])
            composed = dec(x, states[1], torch.full((N,), T))
            assert torch.equal(kernel, composed), f"step of {T}"
            if T == 1:
                assert not any(e.name in KERNEL_OPS for e in prof.events())
    for mine, theirs in zip(states[0]._cache(), states[1]._cache()):
        assert mine is None or torch.equal(mine, theirs)


def test_a_kernel_step_into_a_full_cache_raises_as_the_composition_and_leaves_the_state():
    """The kernel step leaves a full cache to the composition: the same error, nothing written."""
    model = make_model(dtype=torch.float32)
    dec = torchmha.CachedDecoder(model)
    state = dec.new_state(2, 2, torch.randn(S, 2, E))
    with torch.inference_mode():
        dec(torch.randn(2, 2, E), state)
        before = [t.clone() for t in state._cache()]
        with pytest.raises(RuntimeError, match="the key/value cache is full: sequence 0 holds 2 of its 2 positions"):
            dec(torch.randn(1, 2, E), state)
    assert all(torch.equal(a, b) for a, b in zip(before, state._cache()))


@pytest.mark.parametrize("activation, op", [("relu", "aten::relu_"), ("gelu", "aten::gelu_"), (F.silu, "aten::silu_")])
def test_a_step_activates_the_hidden_in_place(activation, op):
    """The feed-forward's hidden (the first linear's own output) is activated in place, one op a
    layer and no new tensor; the step still equals the full forward."""
    model = make_model(activation=activation, dtype=torch.float32)
    g = Generation(model, N=2, max_length=6, dtype=torch.float32)
    g.step([2, 3])
    with torch.inference_mode(), torch.profiler.profile() as prof:
        g.step([1, 1])
    names = [e.name for e in prof.events()]
    assert names.count(op) == LAYERS and names.count(op.rstrip("_")) == 0
    g.check()


def test_residual_norm_setting_keeps_atens_add_and_layer_norm():
    """TORCHMHA_RESIDUAL_NORM=0: the same steps through ATen's add and layer_norm (the path with
    gradients, traces and float64), within the same bound."""
    import pathlib
    from helpers import run_python_with
    code = ("import sys, torch; sys.path.insert(0, %r); import test_cached_decoder as t; "
            "[t.test_post_norm_steps_without_gradients_within_torchs_own_error(d, c) "
            "for d in (torch.float32, torch.bfloat16) for c in (dict(kind='decoder'), dict(kind='encoder', bias=False))]")
    run_python_with(code % str(pathlib.Path(__file__).parent), set_env={"TORCHMHA_RESIDUAL_NORM": "0"})


# --------------------------------------------------------------------------- bad input


def state_snapshot(state):
    return [t.clone() for t in (state.keys, state.values, state.lengths)]


def assert_state_unchanged(g, snapshot):
    """The lengths are as they were and the next step still equals the full forward."""
    assert torch.equal(g.state.lengths, snapshot[2])
    g.step([1] * len(g.tokens))
    g.check()


def test_passing_max_length_raises_naming_the_lengths_and_leaves_the_state():
    g = Generation(make_model("decoder"), N=2, max_length=6, dtype=torch.float64)
    g.step([4, 2])
    snapshot = state_snapshot(g.state)
    with pytest.raises(RuntimeError, match="holds 4 of its 6 positions and cannot take 3 more"):
        g.dec(torch.randn(3, 2, E, dtype=torch.float64), g.state)
    assert_state_unchanged(g, snapshot)


@pytest.mark.parametrize("bad, error, match", [
    (lambda: torch.randn(1, 3, E, dtype=torch.float64), ValueError, "holds 2 sequences, but tgt"),
    (lambda: torch.randn(1, 2, E + 1, dtype=torch.float64), ValueError, "d_model is 16"),
    (lambda: torch.randn(1, 2, E), RuntimeError, "must have the state's dtype and device"),
    (lambda: torch.randn(1, 2, E, dtype=torch.float64, device="meta"), RuntimeError, "dtype and device"),
    (lambda: torch.randn(2, E, dtype=torch.float64), AssertionError, r"expected tgt of shape \(T, N, E\)"),
])
def test_bad_steps_raise_and_leave_the_state(bad, error, match):
    g = Generation(make_model("decoder"), N=2, max_length=6, dtype=torch.float64)
    g.step([2, 1])
    snapshot = state_snapshot(g.state)
    with pytest.raises(error, match=match):
        g.dec(bad(), g.state)
    assert_state_unchanged(g, snapshot)


def test_bad_new_lengths_leave_the_state():
    g = Generation(make_model("encoder"), N=2, max_length=6, dtype=torch.float64)
    g.step([2, 1])
    snapshot = state_snapshot(g.state)
    with pytest.raises(ValueError, match=r"new_lengths\[1\] must be in \[0, 2\]"):
        g.dec(torch.randn(2, 2, E, dtype=torch.float64), g.state, torch.tensor([1, 3]))
    assert_state_unchanged(g, snapshot)


def test_training_mode_asks_for_eval():
    model = make_model("encoder").train()
    dec = torchmha.CachedDecoder(model)
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        dec(torch.randn(1, 1, E, dtype=torch.float64), dec.new_state(1, 4))


def test_a_backward_through_a_step_is_an_error_not_a_wrong_gradient():
    """Under grad mode a step runs (its output right), but it has no derivative: a backward fails
    with torch's not-implemented error (the default fallback used to warn and return gradients
    without the attention), and so does forward-mode AD."""
    dec = torchmha.CachedDecoder(make_model("decoder"))
    tgt = torch.randn(3, 2, E, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(S, 2, E, dtype=torch.float64)
    out = dec(tgt, dec.new_state(2, 4, memory=memory))
    with torch.no_grad():  # (the cross-attention is SDPA under grad mode, torchmha's kernel without)
        assert_close(out, dec(tgt, dec.new_state(2, 4, memory=memory)), torch.float64)
    not_implemented = "derivative for torchmha::decode_attention is not implemented"
    with pytest.raises(RuntimeError, match=not_implemented):
        out.sum().backward()

    def step(q):
        return torch.ops.torchmha.decode_attention(q, q, q, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4),
                                                   torch.tensor([0]), None, None, 0.0)
    with pytest.raises(RuntimeError, match=not_implemented):
        step(torch.randn(1, 1, 1, 4, requires_grad=True)).sum().backward()
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward AD with torchmha::decode_attention"):
        step(fwAD.make_dual(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)))


def test_memory_for_an_encoder_and_none_for_a_decoder():
    enc = torchmha.CachedDecoder(make_model("encoder"))
    with pytest.raises(ValueError, match="encoder has no memory"):
        enc.new_state(1, 4, memory=torch.randn(S, 1, E, dtype=torch.float64))
    dec = torchmha.CachedDecoder(make_model("decoder"))
    with pytest.raises(ValueError, match="needs memory"):
        dec.new_state(1, 4)
    with pytest.raises(ValueError, match="holds 1 sequences, but batch_size is 2"):
        dec.new_state(2, 4, memory=torch.randn(S, 1, E, dtype=torch.float64))


class MyLayer(nn.TransformerDecoderLayer):
    pass


@pytest.mark.parametrize("make, name", [
    (lambda: nn.Linear(4, 4), "torch.nn.modules.linear.Linear"),
    (lambda: nn.TransformerDecoder(MyLayer(E, H), 1), "MyLayer"),
])
def test_other_modules_raise_type_error_naming_the_type(make, name):
    with pytest.raises(TypeError, match=name):
        torchmha.CachedDecoder(make())


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("activation", ["relu", torch.tanh])
def test_compiled_step_has_no_graph_break_and_no_recompile(activation):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = make_model("decoder", dtype=torch.float32, activation=activation)
    dec = torchmha.CachedDecoder(model)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(dec, backend=counter, fullgraph=True)
    memory = torch.randn(S, 2, E)
    state = dec.new_state(2, 12, memory=memory)
    eager_state = dec.new_state(2, 12, memory=memory)
    with torch.no_grad():
        for t in range(8):
            x = torch.randn(1, 2, E)
            assert_close(step(x, state), dec(x, eager_state), torch.float32)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
