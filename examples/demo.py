"""torchmha demo: swap torch.nn.MultiheadAttention for torchmha's in a small Transformer, check the
numbers match, and time both side by side in this process.

    python examples/demo.py
"""

import copy
from pathlib import Path

import torch
from torch.utils import benchmark

import torchmha


def small_model() -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def median_ms(fn) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=1.0).median * 1e3


def main() -> None:
    torch.manual_seed(0)
    model = small_model().train()
    ours = copy.deepcopy(model)
    replaced = torchmha.replace_multihead_attention(ours)
    x = torch.randn(8, 64, 128)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(64)

    print(f"torchmha {torchmha.__version__} on torch {torch.__version__}: replaced {replaced} attention modules\n")
    # Parity: outputs and gradients of the whole model, before and after the swap.
    y_ref, y_ours = model(x, mask=causal, is_causal=True), ours(x, mask=causal, is_causal=True)
    y_ref.square().sum().backward()
    y_ours.square().sum().backward()
    grad_diff = max(
        (a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), ours.parameters())
    )
    print(f"max |output difference|   {(y_ref - y_ours).abs().max().item():.2e}")
    print(f"max |gradient difference| {grad_diff:.2e}\n")

    # Speed of the attention module itself, the default call, side by side.
    rows = []
    for label, E, H, L, N in [("small (N=1, L=16, E=256)", 256, 4, 16, 1), ("medium (N=8, L=128, E=128)", 128, 4, 128, 8)]:
        ref_attn = torch.nn.MultiheadAttention(E, H)
        our_attn = torchmha.MultiheadAttention(E, H)
        our_attn.load_state_dict(ref_attn.state_dict())
        q = torch.randn(L, N, E)
        t_ref = median_ms(lambda: ref_attn(q, q, q))
        t_ours = median_ms(lambda: our_attn(q, q, q))
        rows.append((label, t_ref, t_ours))
    print(f"{'MultiheadAttention forward':<30}{'torch ms':>10}{'torchmha ms':>13}{'ratio':>8}")
    for label, t_ref, t_ours in rows:
        print(f"{label:<30}{t_ref:>10.3f}{t_ours:>13.3f}{t_ours / t_ref:>8.2f}")
    print("\nratio = torchmha / torch (median of torch.utils.benchmark runs; lower is faster)")

    # One attention map of the swapped model's first layer, causal mask and all.
    try:
        first_attention = ours.layers[0].self_attn
        plot = Path("attention.png").resolve()
        torchmha.plot_module_attention(first_attention, x[:1, :24], attn_mask=causal[:24, :24],
                                       title="first layer, causal self-attention", path=str(plot))
        print(f"wrote {plot} (average attention weights of the first layer)")
    except ImportError as missing:  # matplotlib is optional
        print(f"skipped the attention plot: {missing}")


if __name__ == "__main__":
    main()
