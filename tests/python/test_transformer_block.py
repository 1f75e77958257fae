"""torchmha.TransformerBlock (the article's block): torch's TransformerEncoderLayer's computation,
and a small model of blocks that trains."""

import pytest
import torch

import torchmha
from helpers import assert_close, causal_mask, padding_mask


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
