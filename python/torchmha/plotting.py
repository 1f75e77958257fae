"""Heat maps of attention weights (matplotlib, an optional dependency: ``pip install matplotlib``
or ``pip install torchmha[plot]``).

Figures are built with ``matplotlib.figure.Figure``, not pyplot, so nothing depends on a display or
on pyplot's global state; save them with ``fig.savefig(...)`` or the ``path=`` argument.
"""

from typing import Optional

import torch
from torch import Tensor, nn


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "torchmha.plot_attention needs matplotlib, which is not installed: "
            "pip install matplotlib (or pip install torchmha[plot])"
        ) from error
    return Figure


def _select_map(weights: Tensor, head: Optional[int], batch_index: int) -> Tensor:
    """One (L, S) map out of (L, S), (N, L, S) (averaged over heads) or (N, H, L, S) weights."""
    if weights.dim() not in (2, 3, 4):
        raise ValueError(f"expected attention weights of shape (L, S), (N, L, S) or (N, H, L, S), got {tuple(weights.shape)}")
    if weights.dim() >= 3:
        weights = weights[batch_index]
    if weights.dim() == 3:
        weights = weights.mean(0) if head is None else weights[head]
    elif head is not None:
        raise ValueError("head= needs per-head weights (N, H, L, S); these are already averaged over heads")
    return weights


def plot_attention(
    weights: Tensor,
    *,
    head: Optional[int] = None,
    batch_index: int = 0,
    title: Optional[str] = None,
    path=None,
    cmap: str = "viridis",
):
    """A heat map of attention weights: rows are query positions, columns key positions, with a
    colorbar. ``weights`` is (L, S), (N, L, S) as returned with average_attn_weights=True, or
    (N, H, L, S); ``batch_index`` picks the sequence, ``head`` one head (default: the average over
    heads). Saves a PNG (or any format matplotlib knows) to ``path`` if given. Returns the Figure.
    """
    Figure = _figure_class()
    weight_map = _select_map(weights.detach(), head, batch_index).to(torch.float32).cpu()
    fig = Figure(figsize=(5.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(weight_map.numpy(), cmap=cmap, aspect="auto", interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    default_title = "average over heads" if head is None else f"head {head}"
    ax.set_title(title if title is not None else f"attention weights ({default_title})")
    fig.colorbar(image, ax=ax, label="attention weight")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_module_attention(
    module: nn.Module,
    query: Tensor,
    key: Optional[Tensor] = None,
    value: Optional[Tensor] = None,
    *,
    head: Optional[int] = None,
    batch_index: int = 0,
    title: Optional[str] = None,
    path=None,
    cmap: str = "viridis",
    **forward_kwargs,
):
    """Runs a MultiheadAttention (torchmha's or torch's) with need_weights=True on (query, key,
    value) (key and value default to query: self-attention) without recording gradients, and plots
    the weights with :func:`plot_attention`. Extra keyword arguments (attn_mask, key_padding_mask,
    is_causal) go to the module's forward. Returns the Figure."""
    key = query if key is None else key
    value = key if value is None else value
    with torch.no_grad():
        _, weights = module(query, key, value, need_weights=True, average_attn_weights=head is None, **forward_kwargs)
    if head is not None and weights.dim() == 3:
        weights = weights.unsqueeze(0)  # unbatched input gives per-head weights (H, L, S)
    return plot_attention(weights, head=head, batch_index=batch_index, title=title, path=path, cmap=cmap)
