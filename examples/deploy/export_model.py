"""Trains a small Transformer whose attention is torchmha's, then writes it in the three forms a
program without Python can run, plus a fixed input and the output Python computes for it:

    python examples/deploy/export_model.py OUTPUT_DIR [--formats torchscript,aoti,onnx]

OUTPUT_DIR gets:
    model.pt        TorchScript (torch.jit.script): calls torch.ops.torchmha.*, so the C++ program
                    that loads it must link libtorchmha (TorchMHA::torchmha)
    model.pt2       AOTInductor package (torch.export -> aoti_compile_and_package): compiled aten
                    code, no torchmha op left (the ops are CompositeImplicitAutograd and decompose)
    model.onnx      ONNX (torch.onnx.export(..., dynamo=True)), for onnxruntime
    reference.pt    a TorchScript container with two tensor attributes, `tokens` (the fixed input)
                    and `logits` (eager Python's output for it), which C++ reads with
                    torch::jit::load(path).attr("tokens").toTensor()

examples/deploy/deploy.cpp loads model.pt and model.pt2 in C++ and compares with reference.pt;
tests/python/test_deploy.py runs all of it and checks model.onnx under onnxruntime.
"""

import argparse
import time
from pathlib import Path

import torch
from torch import nn

import torchmha

VOCABULARY = 10
LENGTH = 8
EMBED_DIM = 16
HEADS = 2
STEPS = 60
FORMATS = ("torchscript", "aoti", "onnx")


class Reverser(nn.Module):
    """tokens (N, L) int64 -> logits (N, L, VOCABULARY); trained to output the tokens reversed.

    The encoder is torch's nn.TransformerEncoder; replace_multihead_attention makes its attention
    torchmha's. It runs sequence-first (batch_first=False) so that torch's fused encoder-layer
    inference path, which bypasses the attention module altogether, is never taken: every
    forward, in Python and in the deployed forms, goes through torchmha's op."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCABULARY, EMBED_DIM)
        self.position_embedding = nn.Embedding(LENGTH, EMBED_DIM)
        layer = nn.TransformerEncoderLayer(EMBED_DIM, HEADS, dim_feedforward=2 * EMBED_DIM, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(EMBED_DIM, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (N, L, E)
        x = self.encoder(x.transpose(0, 1)).transpose(0, 1)  # the encoder works on (L, N, E)
        return self.head(x)


class Reference(nn.Module):
    """Only a container: TorchScript saves its tensor attributes, and C++ reads them back."""

    def __init__(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        super().__init__()
        self.tokens = tokens
        self.logits = logits

    def forward(self) -> torch.Tensor:
        return self.logits


def train() -> Reverser:
    torch.manual_seed(0)
    model = Reverser()
    assert torchmha.replace_multihead_attention(model) == 1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        tokens = torch.randint(VOCABULARY, (32, LENGTH))
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCABULARY), tokens.flip(1).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"trained {STEPS} steps, last loss {loss.item():.3f}")
    return model.eval()


def export(output_dir: Path, formats=FORMATS) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    model = train()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCABULARY, (4, LENGTH), generator=generator)
    with torch.no_grad():
        logits = model(tokens)
    torch.jit.save(torch.jit.script(Reference(tokens, logits)), str(output_dir / "reference.pt"))

    if "torchscript" in formats:
        torch.jit.save(torch.jit.script(model), str(output_dir / "model.pt"))
        print(f"wrote {output_dir / 'model.pt'}")
    if "aoti" in formats:
        start = time.perf_counter()
        with torch.no_grad():
            program = torch.export.export(model, (tokens,))
        torch._inductor.aoti_compile_and_package(program, package_path=str(output_dir / "model.pt2"))
        print(f"wrote {output_dir / 'model.pt2'} (export and AOTInductor compile: {time.perf_counter() - start:.1f} s)")
    if "onnx" in formats:
        onnx_program = torch.onnx.export(model, (tokens,), dynamo=True, verbose=False)
        onnx_program.save(str(output_dir / "model.onnx"))
        print(f"wrote {output_dir / 'model.onnx'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of " + ", ".join(FORMATS))
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS)
    if unknown:
        parser.error(f"unknown formats {sorted(unknown)}; choose from {', '.join(FORMATS)}")
    export(args.output_dir, formats)


if __name__ == "__main__":
    main()
