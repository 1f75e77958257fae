"""Checkpoints that cross languages: weights saved by the C++ library (torchmha::save_state_dict)
load into torchmha.MultiheadAttention and torch.nn.MultiheadAttention, weights saved by Python's
torch.save load into the C++ module (torchmha::load_state_dict), with identical outputs.

The C++ side is driven through the bindings in torchmha.cpp, and, for a model trained by a real C++
program, through the examples/cpp binary (TORCHMHA_CPP_EXAMPLE; `make test` builds it)."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import torchmha
from helpers import assert_close

MHA_CONFIGS = [
    dict(embed_dim=16, num_heads=4),
    dict(embed_dim=16, num_heads=2, kdim=8, vdim=12),
    dict(embed_dim=16, num_heads=4, add_bias_kv=True, bias=True),
    dict(embed_dim=16, num_heads=4, bias=False),
]


def _inputs(config, dtype):
    E = config["embed_dim"]
    query = torch.randn(5, 3, E, dtype=dtype)
    key = torch.randn(7, 3, config.get("kdim", E), dtype=dtype)
    value = torch.randn(7, 3, config.get("vdim", E), dtype=dtype)
    attn_mask = torch.rand(5, 7) < 0.3
    attn_mask[:, 0] = False  # every query keeps one key, so no row is all -inf
    return query, key, value, attn_mask


def _cpp_mha(config):
    module = torchmha.cpp.MultiheadAttention(**config)
    module.to(torch.float64)  # the C++ module's to() converts in place and returns None
    return module


def _randomize(module) -> None:
    # Non-zero biases everywhere, so a parameter that is not carried over cannot go unnoticed.
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_()


@pytest.mark.parametrize("config", MHA_CONFIGS, ids=str)
def test_cpp_saved_weights_load_into_python_modules(config, tmp_path):
    cpp_module = _cpp_mha(config)
    _randomize(cpp_module)
    path = tmp_path / "from_cpp.pt"
    torchmha.cpp.save_state_dict(cpp_module, path)

    state = torch.load(path)  # weights_only=True, torch's default: a plain dict of tensors
    assert list(state) == [name for name, _ in cpp_module.named_parameters()]
    ours = torchmha.MultiheadAttention(**config, dtype=torch.float64)
    theirs = nn.MultiheadAttention(**config, dtype=torch.float64)
    ours.load_state_dict(state)
    theirs.load_state_dict(state)

    query, key, value, attn_mask = _inputs(config, torch.float64)
    expected, expected_weights = cpp_module.forward(query, key, value, attn_mask=attn_mask)
    output, weights = ours(query, key, value, attn_mask=attn_mask)
    assert torch.equal(output, expected) and torch.equal(weights, expected_weights)
    torch_output, torch_weights = theirs(query, key, value, attn_mask=attn_mask)
    assert_close(torch_output, expected)
    assert_close(torch_weights, expected_weights)


@pytest.mark.parametrize("config", MHA_CONFIGS, ids=str)
@pytest.mark.parametrize("source", [nn.MultiheadAttention, torchmha.MultiheadAttention], ids=["torch", "torchmha"])
def test_python_saved_weights_load_into_cpp_module(config, source, tmp_path):
    python_module = source(**config, dtype=torch.float64)
    _randomize(python_module)
    path = tmp_path / "from_python.pt"
    torch.save(dict(python_module.state_dict()), path)

    cpp_module = _cpp_mha(config)
    torchmha.cpp.load_state_dict(cpp_module, path)
    for name, parameter in python_module.named_parameters():
        assert torch.equal(dict(cpp_module.named_parameters())[name], parameter), name

    query, key, value, attn_mask = _inputs(config, torch.float64)
    expected = python_module(query, key, value, attn_mask=attn_mask)[0]
    output = cpp_module.forward(query, key, value, attn_mask=attn_mask)[0]
    if source is torchmha.MultiheadAttention:
        assert torch.equal(output, expected)
    else:
        assert_close(output, expected)


def test_cpp_load_rejects_a_checkpoint_of_another_shape(tmp_path):
    path = tmp_path / "small.pt"
    torch.save(dict(nn.MultiheadAttention(8, 2).state_dict()), path)
    with pytest.raises(RuntimeError, match="shape mismatch: \\[in_proj_weight"):
        torchmha.cpp.load_state_dict(torchmha.cpp.MultiheadAttention(16, 2), path)


def test_cpp_load_of_an_ordered_dict_says_to_save_a_plain_dict(tmp_path):
    # LibTorch's unpickler cannot rebuild state_dict()'s OrderedDict; the error says what to do.
    path = tmp_path / "ordered.pt"
    torch.save(nn.MultiheadAttention(8, 2).state_dict(), path)
    with pytest.raises(RuntimeError, match=r"torch.save\(dict\(model.state_dict\(\)\), path\)"):
        torchmha.cpp.load_state_dict(torchmha.cpp.MultiheadAttention(8, 2), path)


# ------------------------------------------------------------------------ the C++ example program


class Reverser(nn.Module):
    """The Python twin of examples/cpp/reverse_sequence.cpp's model: same layers, same names."""

    def __init__(self, attention_class, vocabulary=10, length=8, embed_dim=32, num_heads=2):
        super().__init__()
        self.token_embedding = nn.Embedding(vocabulary, embed_dim)
        self.position_embedding = nn.Embedding(length, embed_dim)
        self.attention = attention_class(embed_dim, num_heads, batch_first=True)
        self.head = nn.Linear(embed_dim, vocabulary)

    def forward(self, tokens):
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(tokens.shape[1]))
        return self.head(self.attention(x, x, x, need_weights=False)[0])


def _example_binary() -> Path:
    configured = os.environ.get("TORCHMHA_CPP_EXAMPLE")
    if configured:
        binary = Path(configured)
        assert binary.is_file(), f"TORCHMHA_CPP_EXAMPLE={configured} does not exist (make test-package builds it)"
        return binary
    binary = Path(__file__).resolve().parents[2] / "build" / "example" / "reverse_sequence"
    if not binary.is_file():
        pytest.skip("examples/cpp is not built (make test-package)")
    return binary


@pytest.fixture(scope="module")
def example_outputs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("cpp_example")
    subprocess.run([str(_example_binary()), str(out_dir)], check=True, capture_output=True, timeout=300)
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("attention_class", [torchmha.MultiheadAttention, nn.MultiheadAttention], ids=["torchmha", "torch"])
def test_model_trained_in_cpp_loads_into_python(example_outputs, attention_class):
    model = Reverser(attention_class)
    model.load_state_dict(torch.load(example_outputs / "reverse_state_dict.pt"))
    model.eval()
    sample = torch.load(example_outputs / "reverse_sample.pt")
    with torch.no_grad():
        logits = model(sample["tokens"])
    if attention_class is torchmha.MultiheadAttention:
        assert torch.equal(logits, sample["logits"])
    else:
        assert_close(logits, sample["logits"])
    # The trained model reverses (the C++ program checked its loss; this checks the weights arrived).
    assert (logits.argmax(-1) == sample["tokens"].flip(1)).float().mean() > 0.9


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_libtorch_archive_of_the_model_reads_in_python(example_outputs):
    # torch::save(module) writes a TorchScript archive; torch.jit.load reads its parameters by name.
    archive = torch.jit.load(str(example_outputs / "reverse_model.pt"))
    state = dict(archive.named_parameters())
    model = Reverser(torchmha.MultiheadAttention)
    model.load_state_dict(state)
    model.eval()
    sample = torch.load(example_outputs / "reverse_sample.pt")
    with torch.no_grad():
        assert torch.equal(model(sample["tokens"]), sample["logits"])
