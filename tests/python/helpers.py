"""Helpers shared by the test files: torch references with copied weights, dtype tolerances,
masks, incremental decoding, and the outcome comparison used by the bad-input catalogue."""

import torch

import torchmha

# Tolerances against torch's own result at the same dtype (the standard of the project), relative to
# the values' magnitude: another torch, BLAS or CPU moves the last bits of logits of 30 by more than
# an absolute 1e-5.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def tolerance(expected, dtype=None):
    """The dtype's tolerance times the largest finite |value| of `expected` (at least 1)."""
    finite = expected[torch.isfinite(expected)] if expected.numel() else expected
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    return TOLERANCE[dtype or expected.dtype] * scale


def assert_close(actual, expected, dtype=None, msg=""):
    """Same NaN pattern and max abs difference within the dtype's tolerance of the values' magnitude."""
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, atol=tolerance(expected, dtype), rtol=0, equal_nan=True, msg=msg or None)


# ------------------------------------------------------------------------ reference modules
def torch_reference_for_separate(module: torch.nn.Module, num_heads: int, dropout: float = 0.0):
    """A torch.nn.MultiheadAttention with the weights of a v1-v3 module (q/k/v/out Linear layers)."""
    E, kdim, vdim = module.q_proj.in_features, module.k_proj.in_features, module.v_proj.in_features
    ref = torch.nn.MultiheadAttention(E, num_heads, dropout=dropout, kdim=kdim, vdim=vdim, dtype=module.q_proj.weight.dtype)
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ref.in_proj_weight.copy_(torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]))
        else:
            ref.q_proj_weight.copy_(module.q_proj.weight)
            ref.k_proj_weight.copy_(module.k_proj.weight)
            ref.v_proj_weight.copy_(module.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([module.q_proj.bias, module.k_proj.bias, module.v_proj.bias]))
        ref.out_proj.weight.copy_(module.out_proj.weight)
        ref.out_proj.bias.copy_(module.out_proj.bias)
    return ref


def mha_pair(*args, dtype=torch.float64, seed=0, **kwargs):
    """(torch's module, torchmha's module) with identical weights."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(*args, dtype=dtype, **kwargs)
    ours = torchmha.MultiheadAttention(*args, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    # Non-zero biases, so a dropped bias cannot go unnoticed.
    with torch.no_grad():
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            if "bias" in name:
                p.normal_()
                q.copy_(p)
    return ref, ours


# ------------------------------------------------------------------------------------ masks
def causal_mask(length):
    """(length, length) bool, True above the diagonal (= not allowed)."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def padding_mask(batch, length):
    """Random key padding (True = ignore) that never hides key 0, so no query is fully masked."""
    mask = torch.rand(batch, length) < 0.3
    mask[:, 0] = False
    return mask


# --------------------------------------------------------------------------------- decoding
def seq_slice(x, start, stop, batch_first):
    return x[:, start:stop] if batch_first else x[start:stop]


def decode(module, x, cache, chunk, batch_first, key_padding_mask=None):
    """Feeds x through forward_with_cache `chunk` positions at a time; returns the joined outputs."""
    length = x.shape[1 if batch_first else 0]
    outputs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        kpm = None if key_padding_mask is None else key_padding_mask[:, :stop]
        outputs.append(module.forward_with_cache(seq_slice(x, start, stop, batch_first), cache, kpm))
    return torch.cat(outputs, dim=1 if batch_first else 0)


# ------------------------------------------------------------------------ outcome comparison
def outcome(fn):
    """('ok', result) or ('error', exception type, message)."""
    try:
        return ("ok", fn())
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return ("error", type(error), str(error))


def flatten(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in flatten(r)]
    return [result]


def torch_fails_on_empty_reshape(expected):
    """torch cannot reshape an empty (0-element) padding mask ("-1 ... is ambiguous") and raises
    where the mask changes nothing; torchmha gives torch's answer without that empty mask
    (docs/testing.md)."""
    return expected[0] == "error" and "0 elements" in expected[2] and "ambiguous" in expected[2]


def assert_same_behaviour(ref_fn, our_fn, context="", ref_without_empty_masks=None):
    """torch's call and torchmha's behave alike: both raise (torchmha an exception of torch's type,
    with a message), or both return the same structure of outputs (as many, None where torch has
    None) with equal values."""
    expected, got = outcome(ref_fn), outcome(our_fn)
    if ref_without_empty_masks is not None and torch_fails_on_empty_reshape(expected):
        expected = outcome(ref_without_empty_masks)
    if expected[0] == "error":
        assert got[0] == "error", f"torch raised {expected[1].__name__}: {expected[2]!r} but torchmha returned ({context})"
        assert issubclass(got[1], expected[1]), f"torch raised {expected[1].__name__}, torchmha {got[1].__name__}: {got[2]} ({context})"
        assert len(got[2]) > 15, f"unhelpful message {got[2]!r} ({context})"
        return got
    assert got[0] == "ok", f"torch succeeded but torchmha raised {got[1].__name__}: {got[2]} ({context})"
    ours, theirs = flatten(got[1]), flatten(expected[1])
    assert len(ours) == len(theirs), f"torchmha returned {len(ours)} outputs, torch {len(theirs)} ({context})"
    assert [a is None for a in ours] == [b is None for b in theirs], (
        f"None outputs differ: torchmha {[a is None for a in ours]}, torch {[b is None for b in theirs]} ({context})"
    )
    for a, b in zip(ours, theirs):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.shape == b.shape, context
            if b.is_meta or b.numel() == 0:
                continue
            tol = tolerance(b) if b.dtype in TOLERANCE else 1e-2
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, equal_nan=True, msg=context)
        else:
            assert a == b, context
    return got


# ------------------------------------------------------------------------ environment settings
def run_python_with(code: str, set_env=None, unset=()):
    """Runs `code` in a fresh interpreter with environment variables set and unset (torchmha reads
    its settings once per process) and asserts it succeeded."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(set_env or {})
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-1000:] + result.stderr[-2000:]


# ------------------------------------------------------------------------ distributed ranks
def finish_rank(group_ready: bool = True):
    """The end of a spawned rank whose test passed: a barrier (no rank tears the group down while
    a peer is still finishing its last collective), the group destroyed, then an exit without the
    interpreter's teardown. Ranks whose test had passed aborted there in CI runs ("terminate
    called without an active exception", SIGABRT; about 1 run in 20 locally, in gloo's or torch's
    static destructors; not from torchmha's kernels, which one of the aborting tests never ran)."""
    import os
    import sys

    import torch.distributed as dist

    if group_ready:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
