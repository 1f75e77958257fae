"""Key/value caching, CrossAttention, TransformerBlock and attention plots (issue 5)."""

import sys

import pytest
import torch
from conftest import assert_close, mha_pair

import torchmha

E, H, N, L = 16, 4, 3, 11


def causal_mask(length):
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def seq_slice(x, start, stop, batch_first):
    return x[:, start:stop] if batch_first else x[start:stop]


def padding_mask(batch, length):
    """Random key padding (True = ignore) that never hides key 0, so no query is fully masked."""
    mask = torch.rand(batch, length) < 0.3
    mask[:, 0] = False
    return mask


def decode(module, x, cache, chunk, batch_first, key_padding_mask=None):
    """Feeds x through forward_with_cache `chunk` positions at a time; returns the joined outputs."""
    length = x.shape[1 if batch_first else 0]
    outputs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        kpm = None if key_padding_mask is None else key_padding_mask[:, :stop]
        outputs.append(module.forward_with_cache(seq_slice(x, start, stop, batch_first), cache, kpm))
    return torch.cat(outputs, dim=1 if batch_first else 0)


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 3, 4, L])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_decoding_equals_full_causal_forward(dtype, chunk, batch_first, padded):
    ref, ours = mha_pair(E, H, batch_first=batch_first, dtype=dtype)
    ref.eval(), ours.eval()
    x = torch.randn((N, L, E) if batch_first else (L, N, E), dtype=dtype)
    kpm = padding_mask(N, L) if padded else None
    expected = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(L), need_weights=False)[0]
    cache = torchmha.KeyValueCache.for_module(ours, batch_size=N, max_length=L + 5)
    with torch.no_grad():
        actual = decode(ours, x, cache, chunk, batch_first, kpm)
    assert cache.length == L
    assert_close(actual, expected, dtype, f"chunk={chunk}")


def test_chunk_mask_is_bottom_right_aligned():
    """A chunk after a prefix must see the whole prefix (SDPA's top-left is_causal would not)."""
    ref, ours = mha_pair(E, H, seed=3)
    x = torch.randn(8, 2, E, dtype=torch.float64)
    expected = ref(x, x, x, attn_mask=causal_mask(8), need_weights=False)[0]
    cache = torchmha.KeyValueCache.for_module(ours, 2, 8)
    with torch.no_grad():
        ours.forward_with_cache(x[:5], cache)
        tail = ours.forward_with_cache(x[5:], cache)
    assert_close(tail, expected[5:])


def test_cpp_module_decoding_matches_python():
    ref, ours = mha_pair(E, H, dtype=torch.float32, seed=5)
    cpp_mha = torchmha.cpp.MultiheadAttention(E, H)
    torchmha.cpp.copy_parameters(ours, cpp_mha)
    cpp_mha.eval()
    x = torch.randn(L, N, E)
    kpm = padding_mask(N, L)
    expected = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(L), need_weights=False)[0]
    cache = torchmha.cpp.KeyValueCache.for_module(cpp_mha, N, L)
    with torch.no_grad():
        actual = decode(cpp_mha, x, cache, 2, False, kpm)
    assert cache.length == L and cache.keys.shape == (N, H, L, E // H)
    assert_close(actual, expected, torch.float32)


def test_forward_is_unchanged_and_cache_holds_projected_keys():
    ref, ours = mha_pair(E, H)
    x = torch.randn(5, N, E, dtype=torch.float64)
    assert_close(ours(x, x, x)[0], ref(x, x, x)[0])
    cache = torchmha.KeyValueCache.for_module(ours, N, 8)
    with torch.no_grad():
        ours.forward_with_cache(x, cache)
    w_k, b_k = ours.in_proj_weight[E : 2 * E], ours.in_proj_bias[E : 2 * E]
    keys = (x @ w_k.T + b_k).view(5, N, H, E // H).permute(1, 2, 0, 3)
    assert_close(cache.keys[:, :, :5], keys)
    assert cache.keys[:, :, 5:].abs().sum() == 0  # untouched beyond length


# ---------------------------------------------------------------------- cache life cycle
def test_reset_and_reuse_for_a_new_batch():
    ref, ours = mha_pair(E, H, batch_first=True)
    cache = torchmha.KeyValueCache.for_module(ours, 2, L)
    storage = cache.keys.data_ptr()
    with torch.no_grad():
        for batch in (2, 2, 4):
            cache.reset(batch_size=batch)
            x = torch.randn(batch, L, E, dtype=torch.float64)
            expected = ref(x, x, x, attn_mask=causal_mask(L), need_weights=False)[0]
            assert_close(decode(ours, x, cache, 1, True), expected)
            if batch == 2:
                assert cache.keys.data_ptr() == storage  # same batch size: storage reused
    assert cache.batch_size == 4


def test_full_cache_and_wrong_batch_raise_clearly_and_leave_cache_unchanged():
    _, ours = mha_pair(E, H)
    cache = torchmha.KeyValueCache.for_module(ours, N, 4)
    with torch.no_grad():
        ours.forward_with_cache(torch.randn(3, N, E, dtype=torch.float64), cache)
        with pytest.raises(RuntimeError, match="cache is full: it holds 3 of its 4 positions and cannot take 2 more"):
            ours.forward_with_cache(torch.randn(2, N, E, dtype=torch.float64), cache)
        assert cache.length == 3
        with pytest.raises(AssertionError, match=r"hold batches of 3, but query of shape \[1, 5, 16\] has batch size 5; reset the cache"):
            ours.forward_with_cache(torch.randn(1, 5, E, dtype=torch.float64), cache)
        assert cache.length == 3
        with pytest.raises(AssertionError, match=r"key_padding_mask of shape \(3, 4\)"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache, torch.zeros(N, 1, dtype=torch.bool))
        with pytest.raises(RuntimeError, match=r"float masks must have the dtype of query \(Double\), but the masks given combine to Float"):
            ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache, torch.zeros(N, 4))
        assert cache.length == 3
        assert not cache.keys[:, :, 3:].any(), "a rejected step must not write into the cache"
    with pytest.raises(ValueError, match="greater than 0"):
        torchmha.KeyValueCache(0, H, 4, E // H)


def test_unsupported_options_are_rejected():
    mha = torchmha.MultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(RuntimeError, match="add_bias_kv"):
        mha.forward_with_cache(torch.randn(1, 1, E), torchmha.KeyValueCache.for_module(mha, 1, 2))
    with pytest.raises(RuntimeError, match=r"needs kdim == vdim == embed_dim \(16\), but kdim is 5 and vdim 5"):
        cross = torchmha.MultiheadAttention(E, H, kdim=5, vdim=5)
        cross.forward_with_cache(torch.randn(1, 1, E), torchmha.KeyValueCache.for_module(cross, 1, 2))


def test_keys_split_into_other_heads_are_rejected():
    """H heads of E/H and 2H heads of E/(2H) hold the same features: the ops alone cannot tell
    them apart, so the module checks its own split instead of attending with the wrong heads."""
    mha = torchmha.MultiheadAttention(E, H)
    x = torch.randn(1, 1, E)
    message = rf"has keys of shape \[1, {2 * H}, 3, {E // H // 2}\] .* the module has {H} heads of size {E // H}"
    cache = torchmha.KeyValueCache(1, 2 * H, 3, E // H // 2)
    with torch.no_grad(), pytest.raises(AssertionError, match=message):
        mha.forward_with_cache(x, cache)
    assert cache.length == 0
    memory = torchmha.StaticKeyValue(torch.randn(1, 2 * H, 3, E // H // 2), torch.randn(1, 2 * H, 3, E // H // 2))
    with torch.no_grad(), pytest.raises(AssertionError, match="the projected memory"):
        mha.forward_with_cache(x, memory)


def test_cache_of_another_dtype_is_rejected_before_it_is_written():
    _, ours = mha_pair(E, H)  # float64
    cache = torchmha.KeyValueCache(N, H, 4, E // H, dtype=torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"cache must have query's dtype and device \(Double"):
        ours.forward_with_cache(torch.randn(1, N, E, dtype=torch.float64), cache)
    assert cache.length == 0 and not cache.keys.any()


def test_a_cache_of_the_cpp_classes_is_named_as_such():
    mha = torchmha.MultiheadAttention(E, H)
    cpp_cache = torchmha.cpp.KeyValueCache(1, H, 2, E // H)
    with pytest.raises(TypeError, match=r"not torchmha\._C\.cpp\.KeyValueCache \(the torchmha\.cpp classes"):
        mha.forward_with_cache(torch.randn(1, 1, E), cpp_cache)


def test_cross_attention_cache_step_needs_the_projected_context():
    attn = torchmha.CrossAttention(8, heads=2, dim_head=4)
    with pytest.raises(TypeError, match=r"project_context\(context\), not Tensor"):
        attn.forward_with_cache(torch.randn(1, 2, 8), torch.randn(1, 3, 8))


def test_cached_op_rejects_projections_that_do_not_fit_the_cache():
    w = torch.randn(E, E)
    cache = dict(k_cache=torch.zeros(1, H, 4, E // H), v_cache=torch.zeros(1, H, 4, E // H), cache_length=0, num_heads=H)
    step = dict(query=torch.randn(1, 1, E), out_proj_weight=w, out_proj_bias=None, in_proj_bias=None)
    with pytest.raises(AssertionError, match=r"expected key weight \(w_k\) of shape \(16, 16\), but got \[8, 16\]"):
        torch.ops.torchmha.attention_with_cache(
            **cache, **step, in_proj_weight=None, q_proj_weight=w, k_proj_weight=w[:8], v_proj_weight=w)
    with pytest.raises(RuntimeError, match=r"in_proj_weight must have shape \(3 \* embed_dim, embed_dim\), but got \[32, 16\]"):
        torch.ops.torchmha.attention_with_cache(**cache, **step, in_proj_weight=torch.randn(2 * E, E))


# ------------------------------------------------------------------ cross-attention cache
@pytest.mark.parametrize("kdim", [None, 7])
def test_memory_projected_once_equals_cross_attention(kdim):
    ref, ours = mha_pair(E, H, kdim=kdim, vdim=kdim, batch_first=True)
    memory = torch.randn(N, 9, kdim or E, dtype=torch.float64)
    kpm = padding_mask(N, 9)
    memory_kv = ours.project_key_value(memory)
    assert memory_kv.keys.shape == (N, H, 9, E // H)
    x = torch.randn(N, L, E, dtype=torch.float64)
    expected = ref(x, memory, memory, key_padding_mask=kpm, need_weights=False)[0]
    steps = [ours.forward_with_cache(x[:, t : t + 1], memory_kv, kpm) for t in range(L)]
    assert_close(torch.cat(steps, 1), expected)


# -------------------------------------------------------------------------- CrossAttention
def cross_attention_reference(m, x, context, keep):
    """The intended computation, in plain torch."""
    heads, d = m.heads, m.dim_head
    q, k, v = x @ m.to_q.weight.T, context @ m.to_k.weight.T, context @ m.to_v.weight.T
    q, k, v = (t.unflatten(-1, (heads, d)).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) * d**-0.5
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
    return out @ m.to_out.weight.T + m.to_out.bias


def test_cross_attention_own_inner_width_matches_reference():
    m = torchmha.CrossAttention(12, context_dim=6, heads=3, dim_head=5, dtype=torch.float64)
    assert m.to_q.weight.shape == (15, 12) and m.to_out.weight.shape == (12, 15) and m.to_k.bias is None
    x, context = torch.randn(2, 7, 12, dtype=torch.float64), torch.randn(2, 9, 6, dtype=torch.float64)
    keep = torch.rand(2, 9) > 0.3
    keep[:, 0] = True
    assert_close(m(x, context, keep), cross_attention_reference(m, x, context, keep))
    assert_close(m(x, context), cross_attention_reference(m, x, context, None))
    # mask True = keep: the opposite convention gives another result.
    assert not torch.allclose(m(x, context, keep), m(x, context, ~keep | ~keep.any(1, keepdim=True)))


def test_cross_attention_context_defaults_to_input_and_cache_reuses_it():
    m = torchmha.CrossAttention(10, heads=2, dim_head=8, dtype=torch.float64)
    x = torch.randn(3, 5, 10, dtype=torch.float64)
    assert_close(m(x), cross_attention_reference(m, x, x, None))
    context = torch.randn(3, 4, 10, dtype=torch.float64)
    cached = m.project_context(context)
    for t in range(5):
        assert_close(m.forward_with_cache(x[:, t : t + 1], cached), m(x[:, t : t + 1], context))


def test_cross_attention_gradients_and_dropout():
    m = torchmha.CrossAttention(4, context_dim=3, heads=2, dim_head=3, dtype=torch.float64)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    context = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c: m(a, c), (x, context))
    with_dropout = torchmha.CrossAttention(8, heads=2, dim_head=4, dropout=0.5)
    y = torch.randn(2, 6, 8)
    assert not torch.equal(with_dropout(y), with_dropout(y))
    with_dropout.eval()
    assert torch.equal(with_dropout(y), with_dropout(y))


def test_cpp_cross_attention_matches_python():
    py = torchmha.CrossAttention(12, context_dim=6, heads=3, dim_head=5)
    cpp = torchmha.cpp.CrossAttention(12, context_dim=6, heads=3, dim_head=5)
    torchmha.cpp.copy_parameters(py, cpp)
    x, context = torch.randn(2, 7, 12), torch.randn(2, 9, 6)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 4:] = False
    assert_close(cpp.forward(x, context, keep), py(x, context, keep), torch.float32)
    assert_close(cpp.forward_with_cache(x, cpp.project_context(context), keep), py(x, context, keep), torch.float32)


def test_cross_attention_rejects_non_bool_mask():
    m = torchmha.CrossAttention(8, heads=2, dim_head=4)
    with pytest.raises(AssertionError, match="bool"):
        m(torch.randn(1, 2, 8), mask=torch.ones(1, 2))


# ------------------------------------------------------------------------- TransformerBlock
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transformer_block_equals_torch_encoder_layer(norm_first, dtype):
    torch.manual_seed(0)
    theirs = torch.nn.TransformerEncoderLayer(
        16, 4, dim_feedforward=48, dropout=0.1, activation="relu", batch_first=True, norm_first=norm_first, dtype=dtype
    ).eval()
    ours = torchmha.TransformerBlock(16, 4, dropout=0.1, forward_expansion=3, norm_first=norm_first, dtype=dtype).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 7, 16, dtype=dtype)
    kpm = padding_mask(3, 7)
    assert_close(ours(x), theirs(x), dtype)
    assert_close(ours(x, attn_mask=causal_mask(7), key_padding_mask=kpm), theirs(x, causal_mask(7), kpm), dtype)


def test_cpp_transformer_block_matches_python():
    py = torchmha.TransformerBlock(16, 4, forward_expansion=2, norm_first=True).eval()
    cpp = torchmha.cpp.TransformerBlock(16, 4, forward_expansion=2, norm_first=True)
    torchmha.cpp.copy_parameters(py, cpp)
    cpp.eval()
    x = torch.randn(2, 5, 16)
    assert_close(cpp.forward(x, causal_mask(5)), py(x, causal_mask(5)), torch.float32)


def test_small_model_of_blocks_trains():
    """A small model of two blocks (post-norm and pre-norm) trains: the loss falls."""
    torch.manual_seed(0)
    vocab, dim = 12, 32
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim),
        torchmha.TransformerBlock(dim, 4, forward_expansion=2),
        torchmha.TransformerBlock(dim, 4, forward_expansion=2, norm_first=True),
        torch.nn.Linear(dim, vocab),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens = torch.randint(vocab, (16, 10))
    # Every position predicts the sequence's largest token: it needs attention across positions,
    # and no positional encoding (a function of the set of tokens).
    targets = tokens.max(1, keepdim=True).values.expand_as(tokens)
    losses = []
    for _ in range(60):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses[::10]


# ------------------------------------------------------------------------------- plotting
def test_plot_attention_writes_png_with_labels(tmp_path):
    pytest.importorskip("matplotlib")
    weights = torch.rand(2, 4, 5, 6).softmax(-1)
    path = tmp_path / "attention.png"
    fig = torchmha.plot_attention(weights, head=1, batch_index=1, path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image_ax, colorbar_ax = fig.axes
    assert image_ax.get_xlabel() == "key position" and image_ax.get_ylabel() == "query position"
    assert torch.allclose(torch.as_tensor(image_ax.images[0].get_array()), weights[1, 1].float())
    average = torchmha.plot_attention(weights).axes[0].images[0].get_array()
    assert torch.allclose(torch.as_tensor(average), weights[0].mean(0).float())
    with pytest.raises(ValueError, match="already averaged"):
        torchmha.plot_attention(weights[:, 0], head=0)


def test_plot_module_attention_runs_with_need_weights(tmp_path):
    pytest.importorskip("matplotlib")
    mha = torchmha.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 6, E)
    fig = torchmha.plot_module_attention(mha, x, head=2, attn_mask=causal_mask(6), path=tmp_path / "a.png")
    expected = mha(x, x, x, attn_mask=causal_mask(6), average_attn_weights=False)[1][0, 2]
    assert torch.allclose(torch.as_tensor(fig.axes[0].images[0].get_array()), expected.detach())
    assert (tmp_path / "a.png").stat().st_size > 0


def test_plot_attention_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        torchmha.plot_attention(torch.rand(3, 3))


def test_compiled_decoding_step_compiles_once_for_every_cache_length():
    """torch.compile(dynamic=True) of a cached step: the op takes the cache length as a SymInt and
    keeps it symbolic, so after the first lengths (0 and 1 are specialised, as dynamo always does)
    every further step reuses one graph; the outputs still equal one causal forward of torch's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ref, ours = mha_pair(E, H)
    ours.eval()
    ref.eval()
    x = torch.randn(L, N, E, dtype=torch.float64)
    kpm = padding_mask(N, L)
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def step(query, cache, key_padding_mask):
        return ours.forward_with_cache(query, cache, key_padding_mask)

    # Room to spare: the step that fills a cache to the last position compiles once more (a
    # narrow over the whole length is specialised).
    cache = torchmha.KeyValueCache.for_module(ours, N, L + 4)
    frames = []
    with torch.no_grad():
        # A 3-token prefill (the causal mask is built), then one token at a time. The masks are
        # fresh contiguous tensors, as a decoding loop makes them.
        outputs = [step(x[:3], cache, kpm[:, :3].clone())]
        for t in range(3, L):
            outputs.append(step(x[t : t + 1], cache, kpm[:, : t + 1].clone()))
            frames.append(counter.frame_count)
        expected = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(L), need_weights=False)[0]
    assert_close(torch.cat(outputs), expected, torch.float64)
    assert cache.length == L
    assert frames[-1] == frames[2], f"recompiled as the cache grew: frames after each step {frames}"
    assert frames[-1] <= 3, frames
