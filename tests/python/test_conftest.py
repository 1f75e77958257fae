"""conftest.py's rule for the `slow` mark: a test that starts an interpreter is slow without saying so."""

from helpers import run_python_with


def test_a_test_naming_run_python_with_is_slow(request):
    assert callable(run_python_with)  # named, not called: the name is what conftest keys on
    assert request.node.get_closest_marker("slow") is not None


def test_a_test_starting_no_interpreter_is_not_slow(request):
    assert request.node.get_closest_marker("slow") is None
