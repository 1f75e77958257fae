"""The registered ops (torch.ops.torchmha.*) as ops: opcheck, torch.compile, torch.export, function
transforms, and the gradient to a float mask. Compiled decoding is in test_kv_cache.py."""

import pytest
import torch
from torch.library import opcheck

import inspect

import torchmha
from helpers import assert_close, mha_pair
from torchmha._ops import attention_options, attention_parameters, block_options, decoding_options


class TinyModel(torch.nn.Module):
    """An attention layer with a projection around it, as a model would use it."""

    def __init__(self, need_weights: bool, batch_first: bool = True):
        super().__init__()
        self.attn = torchmha.MultiheadAttention(16, 4, batch_first=batch_first)
        self.head = torch.nn.Linear(16, 3)
        self.need_weights = need_weights

    def forward(self, x, key_padding_mask=None):
        out, weights = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=self.need_weights)
        y = self.head(out)
        return y if weights is None else y + weights.sum()


@pytest.mark.parametrize("need_weights", [False, True])
def test_compile_fullgraph_matches_eager_forward_and_backward(need_weights):
    torch.manual_seed(0)
    model = TinyModel(need_weights)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break fails
    x = torch.randn(2, 5, 16, requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, -2:] = True
    expected = model(x, kpm)
    got = compiled(x, kpm)
    assert_close(got, expected, torch.float32)
    (gx_ref,) = torch.autograd.grad(expected.sum(), [x])
    (gx,) = torch.autograd.grad(got.sum(), [x])
    assert_close(gx, gx_ref, torch.float32)


def test_compile_inductor_inference():
    torch.manual_seed(0)
    model = TinyModel(need_weights=False).eval()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert_close(compiled(x), model(x), torch.float32)


def test_python_argument_runs_follow_the_schemas():
    """The ops' schemas are written from the C++ argument structs; the Python helpers that spell
    the same runs positionally must list the same names, in the same order, with the same defaults."""
    ops = torch.ops.torchmha
    helpers = (attention_parameters, attention_options, decoding_options, block_options)
    runs = {helper: inspect.signature(helper).parameters for helper in helpers}
    params, options, decoding, block = (list(runs[h]) for h in helpers)
    expected = {
        ops.multi_head_attention_forward: ["query", "key", "value", "embed_dim", *params, *options],
        ops.attention_with_cache: ["query", "k_cache", "v_cache", "lengths", *params, *decoding, "new_lengths"],
        ops.attention_with_static_key_value: ["query", "keys", "values", *params, *decoding],
        ops.project_key_value: ["key", "value", *params, "batch_first"],
        ops.cross_attention: ["x", "keys", "values", *params, "mask", "training"],
    }
    for op, names in expected.items():
        assert [a.name for a in op.default._schema.arguments] == names, op
    block_names = [a.name for a in ops.transformer_block.default._schema.arguments]
    assert block_names[-len(params) - len(block):] == [*params, *block]
    for helper, op in ((attention_parameters, ops.multi_head_attention_forward),
                       (attention_options, ops.multi_head_attention_forward), (decoding_options, ops.attention_with_cache),
                       (block_options, ops.transformer_block)):
        schema = {a.name: a for a in op.default._schema.arguments}
        for name, parameter in runs[helper].items():
            default = schema[name].default_value if schema[name].has_default_value() else inspect.Parameter.empty
            assert default == parameter.default, (helper.__name__, name)


def test_transformer_block_takes_only_what_it_uses():
    """The block is batch first and returns no weights: its op has no argument it would ignore."""
    names = {a.name for a in torch.ops.torchmha.transformer_block.default._schema.arguments}
    assert not names & {"need_weights", "average_attn_weights", "batch_first", "static_k", "static_v"}
    assert {"key_padding_mask", "attn_mask", "training", "dropout_p"} <= names


def test_decoder_reset_schema_writes_only_what_it_changes():
    """A reset empties sequences and may replace their memory: it writes lengths and the memory,
    never the key/value caches (a schema that says it does makes functionalization copy them)."""
    args = {a.name: a for a in torch.ops.torchmha.decoder_reset.default._schema.arguments}
    written = {name for name, a in args.items() if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"lengths", "memory_keys", "memory_values", "memory_padding"}


def test_new_arguments_reject_bad_values_by_name():
    """The arguments torch's functions do not have (head_dim) or had as required (out_proj_weight)."""
    ops = torch.ops.torchmha
    E, H = 8, 2
    x = torch.randn(3, 1, E)
    w, out = torch.randn(3 * E, E), torch.randn(E, E)
    with pytest.raises(AssertionError, match="head_dim must be greater than 0, but got 0"):
        ops.multi_head_attention_forward(x, x, x, E, *attention_parameters(H, 0, w, out_proj_weight=out))
    with pytest.raises(RuntimeError, match=r"in_proj_weight must have shape \(3 \* embed_dim, embed_dim\) = \(6, 8\)"):
        ops.multi_head_attention_forward(x, x, x, E, *attention_parameters(H, 1, w, out_proj_weight=out))
    with pytest.raises(AssertionError, match="out_proj_weight is None"):
        ops.multi_head_attention_forward(x, x, x, E, *attention_parameters(H, None, w))
    cache = (torch.zeros(1, H, 4, E // H), torch.zeros(1, H, 4, E // H), torch.zeros(1, dtype=torch.long))
    with pytest.raises(AssertionError, match="head_dim 2 times num_heads 2 is not the in-projection's width 8"):
        ops.attention_with_cache(x[:1], *cache, *attention_parameters(H, 2, w, out_proj_weight=out))
    # a head size that fits: the same numbers as without it
    expected = ops.multi_head_attention_forward(x, x, x, E, *attention_parameters(H, None, w, out_proj_weight=out))
    got = ops.multi_head_attention_forward(x, x, x, E, *attention_parameters(H, E // H, w, out_proj_weight=out))
    assert_close(got[0], expected[0], torch.float32)


def sample_inputs():
    E = 8
    q = torch.randn(3, 2, E, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(4, 2, E, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3 * E, E, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3 * E, dtype=torch.float64, requires_grad=True)
    ow = torch.randn(E, E, dtype=torch.float64, requires_grad=True)
    ob = torch.randn(E, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(3, 4, dtype=torch.float64)
    params = attention_parameters(2, in_proj_weight=w, in_proj_bias=b, out_proj_weight=ow, out_proj_bias=ob)
    ops = torch.ops.torchmha
    return [
        (ops.in_projection_packed.default, (q, q, q, w, b), {}),
        (ops.in_projection_packed.default, (q, kv, kv, w, None), {}),
        (ops.in_projection.default, (q, kv, kv, ow, ow, ow, ob, ob, ob), {}),
        (ops.multi_head_attention_forward.default, (q, kv, kv, E, *params), dict(attn_mask=mask)),
        # batch_first on transposed (non-contiguous) views: N=2, L=3, S=4
        (ops.multi_head_attention_forward.default,
         (q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), E, *attention_parameters(
             2, in_proj_weight=w, in_proj_bias=b, add_zero_attn=True, out_proj_weight=ow, out_proj_bias=ob)),
         dict(need_weights=False, attn_mask=mask, batch_first=True)),
        # the explicit-weights kernel (inference only: no input requires grad); q (N, H, L, D) strided
        (ops.attention_with_weights.default,
         (q.detach().view(3, 2, 2, 4).permute(1, 2, 0, 3), *(kv.detach().view(4, 2, 2, 4).permute(1, 2, 0, 3),) * 2,
          mask.view(1, 1, 3, 4), True), {}),
        (ops.attention_with_weights.default,
         (*(torch.randn(2, 2, 3, 4, dtype=torch.float32) for _ in range(3)), None, False), {}),
        (ops.attention_with_weights.default,  # the heads in (N, L, H, D) memory
         (*(torch.randn(2, 2, 3, 4, dtype=torch.float32) for _ in range(3)), None, True, True), {}),
    ]


@pytest.mark.parametrize("index", range(len(sample_inputs())))
def test_opcheck(index):
    op, args, kwargs = sample_inputs()[index]
    opcheck(op, args, kwargs)


def test_export_matches_eager():
    torch.manual_seed(0)
    model = TinyModel(need_weights=False)
    x = torch.randn(2, 5, 16)
    exported = torch.export.export(model, (x,))
    # torch's own module would export an SDPA node too: only our op shows the swap held.
    assert any("torchmha.multi_head_attention_forward" in str(node.target) for node in exported.graph.nodes)
    assert_close(exported.module()(x), model(x), torch.float32)


def decoding_samples():
    """The decoding and layer ops: key/value projection (packed and separate weights), attention
    over a static context, a cached step (which writes into its caches in place, as its schema
    declares), CrossAttention's and TransformerBlock's forward."""
    N, H, D, E, max_len = 2, 2, 4, 8, 6
    f64 = dict(dtype=torch.float64)

    def param(*shape):
        return torch.randn(*shape, **f64, requires_grad=True)

    w_in, b_in, w_out, b_out = param(3 * E, E), param(3 * E), param(E, E), param(E)
    w_k, w_v = param(E, 5), param(E, 3)
    query = torch.randn(1, N, E, **f64, requires_grad=True)
    context = torch.randn(5, N, E, **f64)
    keys, values = torch.randn(N, H, 5, D, **f64), torch.randn(N, H, 5, D, **f64)
    ops = torch.ops.torchmha
    block = dict(
        linear1_weight=param(2 * E, E), linear1_bias=param(2 * E), linear2_weight=param(E, 2 * E),
        linear2_bias=param(E), norm1_weight=param(E), norm1_bias=param(E), norm2_weight=param(E),
        norm2_bias=param(E), layer_norm_eps=1e-5, dropout=0.0, norm_first=False, training=False,
    )
    packed = attention_parameters(H, in_proj_weight=w_in, in_proj_bias=b_in, out_proj_weight=w_out, out_proj_bias=b_out)
    detached = attention_parameters(H, in_proj_weight=w_in.detach(), in_proj_bias=b_in.detach(),
                                    out_proj_weight=w_out.detach(), out_proj_bias=b_out.detach())
    return [
        (ops.project_key_value.default, (context, None, *attention_parameters(H, in_proj_weight=w_in, in_proj_bias=b_in)),
         {}),
        (ops.project_key_value.default, (torch.randn(5, N, 5, **f64), torch.randn(5, N, 3, **f64),
                                         *attention_parameters(H, in_proj_bias=b_in, k_proj_weight=w_k, v_proj_weight=w_v)),
         {}),
        (ops.attention_with_static_key_value.default, (query, keys, values, *packed), {}),
        (ops.attention_with_cache.default,
         (query.detach(), torch.zeros(N, H, max_len, D, **f64), torch.zeros(N, H, max_len, D, **f64),
          torch.tensor([2, 2]), *detached), {}),
        (ops.attention_with_cache.default,
         (torch.randn(2, N, E, **f64), torch.randn(N, H, max_len, D, **f64), torch.randn(N, H, max_len, D, **f64),
          torch.tensor([3, 0]), *detached),
         {"new_lengths": torch.tensor([1, 2]), "key_padding_mask": torch.tensor([[False] * 4, [False, True, False, False]])}),
        (ops.decode_attention.default,
         (*(torch.randn(N, H, 2, D, **f64) for _ in range(3)), torch.randn(N, H, max_len, D, **f64),
          torch.randn(N, H, max_len, D, **f64), torch.tensor([4, 1]), torch.tensor([2, 1]), None, 0.0), {}),
        (ops.decode_attention.default,  # new_lengths None: every sequence appends all T positions
         (*(torch.randn(N, H, 2, D, **f64) for _ in range(3)), torch.randn(N, H, max_len, D, **f64),
          torch.randn(N, H, max_len, D, **f64), torch.tensor([4, 0]), None, None, 0.0), {}),
        (ops.decode_attention.default,  # a prefill into empty caches: the blocked kernel (float32)
         (*(torch.randn(N, H, 64, D) for _ in range(3)), torch.zeros(N, H, 64, D), torch.zeros(N, H, 64, D),
          torch.tensor([0, 0]), torch.tensor([64, 30]), None, 0.0), {}),
        (ops.static_attention.default,
         (torch.randn(N, H, 2, D, **f64), torch.randn(N, H, 5, D, **f64), torch.randn(N, H, 5, D, **f64),
          torch.tensor([[0.0, -1.0, float("-inf"), 0.5, 0.0], [float("-inf")] * 5], **f64)), {}),
        (ops.static_attention.default, (torch.randn(N, H, 1, D), torch.randn(N, H, 64, D), torch.randn(N, H, 64, D), None),
         {}),
        (ops.reorder_cache.default,
         (torch.randn(N, H, max_len, D, **f64), torch.randn(N, H, max_len, D, **f64), torch.tensor([3, 1]),
          torch.tensor([1, 1])), {}),
        (ops.reset_cache.default, (torch.tensor([3, 1]), torch.tensor([1])), {}),
        (ops.cross_attention.default,
         (query.transpose(0, 1), keys, values,
          *attention_parameters(H, q_proj_weight=param(E, E), out_proj_weight=w_out, out_proj_bias=b_out)),
         {"mask": torch.rand(N, 5) > 0.2}),
        (ops.transformer_block.default, (torch.randn(N, 3, E, **f64, requires_grad=True),),
         dict(block, num_heads=H, in_proj_weight=w_in, in_proj_bias=b_in, out_proj_weight=w_out, out_proj_bias=b_out)),
    ]


@pytest.mark.parametrize("index", range(len(decoding_samples())))
def test_opcheck_decoding_ops(index):
    op, args, kwargs = decoding_samples()[index]
    opcheck(op, args, kwargs)


@pytest.mark.parametrize("need_weights", [True, False])
def test_function_transforms_match_torch(need_weights):
    """Forward-mode AD (torch.func.jvp) and vmap through the op: out= variants inside the core
    would break the first, so it guards the core's choice of ops. SDPA's CPU flash kernel (the
    need_weights=False path, in torch too) has no forward AD, so SDPA runs its math backend here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref, ours = mha_pair(8, 2)
    x, tangent = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(3, 2, 8, dtype=torch.float64)
    mask = torch.randn(3, 3, dtype=torch.float64)

    def call(module):
        return lambda x: module(x, x, x, attn_mask=mask, need_weights=need_weights)[0]

    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.func.jvp(call(ref), (x,), (tangent,))
        got = torch.func.jvp(call(ours), (x,), (tangent,))
    assert_close(got[0], expected[0], torch.float64, "jvp primal")
    assert_close(got[1], expected[1], torch.float64, "jvp tangent")
    batch = torch.randn(4, 3, 2, 8, dtype=torch.float64)
    assert_close(torch.func.vmap(call(ours))(batch), torch.func.vmap(call(ref))(batch), torch.float64, "vmap")


def test_gradient_reaches_a_float_attn_mask():
    """A float attn_mask is an input like any other: its gradient matches torch's (the core adds
    it to the scores in place, which autograd must see)."""
    ref, ours = mha_pair(8, 2)
    x, upstream = torch.randn(4, 2, 8, dtype=torch.float64), torch.randn(4, 2, 8, dtype=torch.float64)
    base_mask = torch.randn(2 * 2, 4, 4, dtype=torch.float64)
    for need_weights in (True, False):
        grads = []
        for module in (ref, ours):
            mask = base_mask.clone().requires_grad_()
            out = module(x, x, x, attn_mask=mask, need_weights=need_weights)[0]
            grads.append(torch.autograd.grad((out * upstream).sum(), mask)[0])
        assert grads[1].abs().sum() > 0
        assert_close(grads[1], grads[0], torch.float64, f"need_weights={need_weights}")


def test_the_avx2_copies_of_the_cpu_kernels_match_torch():
    """The CPU kernels' inner loops are built for AVX2 and AVX-512, and a CPU runs one copy
    (cpu_capability.h follows ATen's choice): with ATen held to AVX2, a child process runs the
    other copy through parity tests of both kernels."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU runs the AVX2 copy (or neither) in every test already")
    here = Path(__file__).parent
    tests = [f"{here / 'test_explicit_attention.py'}::test_many_row_blocks_on_every_thread",
             f"{here / 'test_kv_cache.py'}::test_sequences_at_different_positions_equal_torch_alone"]
    check = "import torch; assert torch.backends.cpu.get_cpu_capability() == 'AVX2'"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=120)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-1000:]


def _bad_kernel_calls():
    """Direct calls of the two kernel ops with shapes that do not fit: (name, call, error)."""
    ops = torch.ops.torchmha
    f64 = dict(dtype=torch.float64)
    q, kv = torch.randn(2, 2, 4, 8, **f64), torch.randn(2, 2, 5, 8, **f64)
    new = torch.randn(2, 2, 1, 8, **f64)

    def weights(k, v, mask=None):
        return lambda: ops.attention_with_weights(q, k, v, mask, True)

    def decode(cache, lengths, new_lengths=None):
        return lambda: ops.decode_attention(new, new, new, cache, cache.clone(), lengths, new_lengths, None, 0.0)

    cache = torch.randn(2, 2, 9, 8, **f64)
    return [
        ("weights: keys of another batch", weights(kv[:1], kv[:1]), "invalid for input of size"),
        ("weights: values of another length", weights(kv, kv[:, :, :3]), "invalid for input of size"),
        ("weights: keys of another head size", weights(kv[..., :6], kv), "invalid for input of size"),
        ("weights: a mask of another batch", weights(kv, kv, torch.randn(3, 2, 4, 5, **f64)), "must match the size"),
        ("decode: a cache of another batch", decode(cache[:1], torch.tensor([3, 1])), "k_cache and v_cache"),
        ("decode: lengths of another batch", decode(cache, torch.tensor([3])), "expected lengths of shape"),
        ("decode: new_lengths of another batch", decode(cache, torch.tensor([3, 1]), torch.tensor([1])),
         "expected new_lengths of shape"),
        ("decode: int32 lengths", decode(cache, torch.tensor([3, 1], dtype=torch.int32)), "dtype int64"),
        ("static: values of another length", lambda: ops.static_attention(q, kv, kv[:, :, :3], None),
         "expected keys and values of one shape"),
        ("static: padding of another length", lambda: ops.static_attention(q, kv, kv, torch.zeros(2, 4, **f64)),
         r"expected padding of shape \(N, S\) = \(2, 5\)"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_kernel_calls())), ids=[c[0] for c in _bad_kernel_calls()])
def test_the_kernel_ops_reject_shapes_that_do_not_fit(index):
    """The CPU kernels read through raw pointers: shapes that do not fit raise (the composition's
    ATen error, or the decode op's own with the shapes) rather than read past a tensor."""
    _, call, error = _bad_kernel_calls()[index]
    with pytest.raises(RuntimeError, match=error):
        call()


def test_the_weights_kernel_op_reads_strided_rows_correctly():
    """Rows that are not contiguous along the head size (the kernel's raw-pointer path does not take
    them) give the same result as contiguous ones."""
    f64 = dict(dtype=torch.float64)
    q, k, v = (torch.randn(2, 3, 8, 5, **f64).transpose(2, 3) for _ in range(3))  # (2, 3, 5, 8), stride(3) = 5
    heads, weights = torch.ops.torchmha.attention_with_weights(q, k, v, None, False)
    expected_weights = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1)
    assert_close(weights, expected_weights, torch.float64, "weights")
    assert_close(heads, expected_weights @ v, torch.float64, "heads")
