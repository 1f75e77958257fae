"""Deploying a model with torchmha's attention, end to end (examples/deploy): the export script
trains a small Transformer and writes TorchScript, an AOTInductor package and ONNX, plus a fixed
input and Python's output; the C++ program runs the first two from LibTorch, onnxruntime the third,
and each must give Python's output (float32, atol = rtol = 1e-5).

The C++ binaries are built by `make test-package` (examples/deploy, linked with --as-needed as on
Ubuntu, to check that TorchMHA::torchmha still loads libtorchmha); the Makefile says where through
TORCHMHA_DEPLOY_EXAMPLE. deploy_without_torchmha, beside it, is the same program not linked against
torchmha, for the error that says what to link."""

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.slow,  # under a minute: training, the AOTInductor compile, the C++ runs
    # The TorchScript path is the point here (torch 2.13 deprecates it in favour of torch.export).
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
EXPORT_SCRIPT = ROOT / "examples" / "deploy" / "export_model.py"
# torch.onnx.export(dynamo=True) needs onnx and onnxscript; the check runs the model in onnxruntime.
HAVE_ONNX = all(importlib.util.find_spec(name) for name in ("onnx", "onnxscript", "onnxruntime"))
# float32. Measured on logits up to ~7: TorchScript 0, AOTInductor 1.4e-6, onnxruntime 1.9e-6 on the
# fixed input; at most 2.9e-6 and 2.4e-6 over 500 random inputs (under a seventh of this tolerance).
TOLERANCE = 1e-5


def _run(command, timeout=600):
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout)
    print(result.stdout, result.stderr, sep="\n")
    return result


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deploy")
    formats = ["torchscript", "aoti"] + (["onnx"] if HAVE_ONNX else [])
    result = _run([sys.executable, EXPORT_SCRIPT, out_dir, "--formats", ",".join(formats)])
    assert result.returncode == 0, f"export_model.py failed:\n{result.stdout}\n{result.stderr}"
    for name in ["model.pt", "model.pt2", "reference.pt"] + (["model.onnx"] if HAVE_ONNX else []):
        assert (out_dir / name).is_file(), f"export_model.py did not write {name}"
    return out_dir


def _binary(name: str) -> Path:
    configured = os.environ.get("TORCHMHA_DEPLOY_EXAMPLE")
    if not configured:
        pytest.skip("TORCHMHA_DEPLOY_EXAMPLE is not set: run through make (make test-python), which builds "
                    "examples/deploy in make test-package and sets it to the deploy binary")
    binary = Path(configured).with_name(name)
    assert binary.is_file(), (
        f"{binary} does not exist (TORCHMHA_DEPLOY_EXAMPLE={configured}; make test-package builds it)"
    )
    return binary


def _reference(artifacts):
    reference = torch.jit.load(str(artifacts / "reference.pt"))
    return reference.tokens, reference.logits


def _max_difference(stdout: str, fmt: str) -> float:
    match = re.search(rf"^{fmt}: max \|C\+\+ - Python\| = (\S+) over 320 values .*: ok$", stdout, re.MULTILINE)
    assert match, f"unexpected output: {stdout!r}"
    return float(match.group(1))


@pytest.mark.parametrize("fmt, model", [("torchscript", "model.pt"), ("aoti", "model.pt2")])
def test_cpp_runs_the_model_as_python_does(artifacts, fmt, model):
    result = _run([_binary("deploy"), fmt, artifacts / model, artifacts / "reference.pt"])
    assert result.returncode == 0, f"deploy {fmt} failed:\n{result.stdout}\n{result.stderr}"
    assert _max_difference(result.stdout, fmt) <= TOLERANCE


def test_cpp_reports_a_mismatch(artifacts, tmp_path):
    # The comparison itself: Python's output shifted by 1e-3 must fail, with exit status 1.
    spec = importlib.util.spec_from_file_location("export_model", EXPORT_SCRIPT)
    export_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_model)
    tokens, logits = _reference(artifacts)
    shifted = tmp_path / "shifted.pt"
    torch.jit.save(torch.jit.script(export_model.Reference(tokens, logits + 1e-3)), str(shifted))
    for fmt, model in [("torchscript", "model.pt"), ("aoti", "model.pt2")]:
        result = _run([_binary("deploy"), fmt, artifacts / model, shifted])
        assert result.returncode == 1, result.stdout + result.stderr
        assert re.search(rf"^{fmt}: max \|C\+\+ - Python\| = 0\.001\d* over 320 values .*: FAILED$", result.stdout,
                         re.MULTILINE), result.stdout


def test_cpp_without_torchmha_says_what_to_link(artifacts):
    binary = _binary("deploy_without_torchmha")
    result = _run([binary, "torchscript", artifacts / "model.pt", artifacts / "reference.pt"])
    assert result.returncode == 2
    message = result.stderr
    assert f"cannot load the TorchScript module '{artifacts / 'model.pt'}'" in message
    assert "it calls torchmha::multi_head_attention_forward" in message
    assert "libtorchmha is not loaded" in message
    assert "find_package(TorchMHA REQUIRED)" in message
    assert "target_link_libraries(<your program> PRIVATE TorchMHA::torchmha)" in message
    assert "torch::jit::load said: Unknown builtin op: torchmha::multi_head_attention_forward" in message


def test_cpp_says_when_its_torchmha_lacks_an_operator(artifacts, tmp_path):
    # A module saved by another torchmha, calling an operator this one lacks (made by renaming the
    # operator in the archive's code): the library is loaded, so the message is about versions.
    newer = tmp_path / "newer.pt"
    with zipfile.ZipFile(artifacts / "model.pt") as source, zipfile.ZipFile(newer, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith(".py"):
                data = data.replace(b"multi_head_attention_forward(", b"multi_head_attention_forward_v2(")
            target.writestr(info, data)
    result = _run([_binary("deploy"), "torchscript", newer, artifacts / "reference.pt"])
    assert result.returncode == 2
    assert "torchmha::multi_head_attention_forward_v2, which the loaded libtorchmha does not have" in result.stderr
    assert "saved with another version of torchmha" in result.stderr
    assert "target_link_libraries" not in result.stderr


def test_aoti_package_needs_no_torchmha(artifacts):
    # torch.export decomposed torchmha's ops into aten: the package runs in a program without torchmha.
    result = _run([_binary("deploy_without_torchmha"), "aoti", artifacts / "model.pt2", artifacts / "reference.pt"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert _max_difference(result.stdout, "aoti") <= TOLERANCE


def test_onnx_runs_in_onnxruntime_as_python_does(artifacts):
    if not HAVE_ONNX:
        pytest.skip("onnx, onnxscript or onnxruntime is not installed (make deps installs them)")
    import onnx
    import onnxruntime

    model = onnx.load(str(artifacts / "model.onnx"))
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}, "a non-standard operator is left"
    tokens, logits = _reference(artifacts)
    session = onnxruntime.InferenceSession(str(artifacts / "model.onnx"), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: tokens.numpy()})
    output = torch.from_numpy(output)
    print(f"onnx: max |onnxruntime - Python| = {(output - logits).abs().max().item():.3g}")
    torch.testing.assert_close(output, logits, atol=TOLERANCE, rtol=TOLERANCE)
