"""Writes attention.png: the causal self-attention weights of a torchmha.MultiheadAttention,
averaged over heads (needs matplotlib).

    python examples/plot_attention_demo.py [output.png]
"""

import sys

import torch

import torchmha


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "attention.png"
    torch.manual_seed(0)
    mha = torchmha.MultiheadAttention(embed_dim=64, num_heads=4, batch_first=True).eval()
    x = torch.randn(1, 16, 64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(16, dtype=torch.bool)
    torchmha.plot_module_attention(mha, x, attn_mask=causal, title="causal self-attention, 4 heads averaged", path=path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
