"""pytest configuration: hypothesis profiles and the per-test seed. Shared helpers are in helpers.py."""

import os

# The blocked kernel (attention without weights) runs where it beat SDPA on the machine it was
# measured on; the tests run it wherever it applies (test_blocked_attention.py checks the rule).
os.environ.setdefault("TORCHMHA_BLOCKED_KERNEL", "1")
# Likewise int8 weights' integer digits (VNNI) and bfloat16 dot products, which the rule takes on AMD
# only (small_linear_kernel.cpp); the tests with each set to 0 check the float loop they replace.
os.environ.setdefault("TORCHMHA_VNNI", "1")
os.environ.setdefault("TORCHMHA_AVX512_BF16", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis budgets: "ci" keeps the whole suite within minutes on 2 cores; TORCHMHA_HYPOTHESIS=dev
# (make check) is the inner loop; TORCHMHA_HYPOTHESIS=long runs many more examples.
settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("TORCHMHA_HYPOTHESIS", "ci"))


SPAWNS = {"run_python_with", "subprocess"}


def pytest_collection_modifyitems(items):
    """A test that starts a fresh interpreter (run_python_with, subprocess: about 1.4 s each for the
    imports alone) is `slow`, as pyproject.toml defines it, whether or not it says so: 94 such tests
    were nine tenths of the quick suite's 5 minutes, which make test runs twice (test-wheel,
    test-torch) beside make check. make test-python runs them all. (Only a test's own names count:
    one that spawns through a helper of another name says @pytest.mark.slow itself.)"""
    for item in items:
        code = getattr(getattr(item, "function", None), "__code__", None)
        if code is not None and SPAWNS & {*code.co_names, *code.co_varnames}:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
