"""Writes reference cases computed by torch.nn.MultiheadAttention, which the C++ GoogleTest suite
replays through torchmha::MultiheadAttention (tests/cpp/test_reference_cases.cpp).

    python tests/reference/make_cases.py OUT.pt

Each case: constructor options, the module's parameters, the call's inputs, torch's outputs.
float64, so the C++ side can hold torch's results to 1e-10. ctest runs this first (a fixture).
"""

import itertools
import sys

import torch


def build_case(index, embed_dim, num_heads, options, call):
    torch.manual_seed(index)
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, dtype=torch.float64, **options).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "bias" in name:
                p.normal_()  # non-zero biases, so a dropped bias shows
    batch_first, batched = options.get("batch_first", False), call["batched"]
    N, L, S = 2, 4, 5

    def seq(length, features):
        if not batched:
            return torch.randn(length, features, dtype=torch.float64)
        return torch.randn((N, length, features) if batch_first else (length, N, features), dtype=torch.float64)

    query = seq(L, embed_dim)
    key = seq(S, options.get("kdim", embed_dim))
    value = seq(S, options.get("vdim", embed_dim))
    kpm = attn_mask = None
    if call["masks"]:
        kpm = torch.zeros((N, S) if batched else (S,), dtype=torch.bool)
        kpm[..., -1] = True
        attn_mask = torch.randn(L, S, dtype=torch.float64).masked_fill(torch.rand(L, S) > 0.7, float("-inf"))
        attn_mask[:, 0] = 0.0
        kpm = kpm.to(torch.float64).masked_fill(kpm, float("-inf"))  # one mask dtype: no deprecation warning
    with torch.no_grad():
        output, weights = module(query, key, value, key_padding_mask=kpm, attn_mask=attn_mask,
                                 need_weights=call["need_weights"], average_attn_weights=call["average"])
    return {
        "embed_dim": embed_dim, "num_heads": num_heads,
        "bias": options.get("bias", True), "add_bias_kv": options.get("add_bias_kv", False),
        "add_zero_attn": options.get("add_zero_attn", False),
        "kdim": options.get("kdim", embed_dim), "vdim": options.get("vdim", embed_dim),
        "batch_first": batch_first,
        "parameters": {name: p.detach().clone() for name, p in module.named_parameters()},
        "query": query, "key": key, "value": value,
        "key_padding_mask": kpm, "attn_mask": attn_mask,
        "need_weights": call["need_weights"], "average_attn_weights": call["average"],
        "output": output, "weights": weights,
    }


def main(path):
    option_sets = [
        {},
        {"bias": False},
        {"add_bias_kv": True, "add_zero_attn": True},
        {"kdim": 3, "vdim": 7},
        {"batch_first": True},
        {"batch_first": True, "kdim": 5, "vdim": 5, "add_zero_attn": True},
    ]
    calls = [dict(batched=b, masks=m, need_weights=w, average=a)
             for b, m, w, a in itertools.product([True, False], [False, True], [True, False], [True, False])
             if w or a]  # average is moot without weights
    cases = [build_case(i, 8, 2, options, call)
             for i, (options, call) in enumerate(itertools.product(option_sets, calls))]
    torch.save(cases, path)
    print(f"wrote {len(cases)} reference cases to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
