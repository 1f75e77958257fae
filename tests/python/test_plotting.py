"""torchmha.plot_attention and plot_module_attention."""

import sys

import pytest
import torch

import torchmha
from helpers import causal_mask

E, H = 16, 4


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
