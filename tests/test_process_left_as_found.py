"""tests/conftest.py's `process_left_as_found` fails a test that leaves the process changed, and the tests after it on
the same worker see the process as it was (issue 63, item 11: a bundle run in-process left gradients off, and
test_xray2ct_physics.py's backward failed when it ran next on the same worker)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import subprocess_env

CHANGING = '''
import random

import numpy as np
import torch

DRAWS = []


def test_gradients_left_off():
    torch.set_grad_enabled(False)


def test_default_dtype_left_double():
    torch.set_default_dtype(torch.float64)


def test_threads_left_changed():
    torch.set_num_threads(torch.get_num_threads() + 1)


def test_draws_random_numbers():
    DRAWS.append((torch.rand(3), np.random.rand(3), random.random()))


def test_draws_them_again():
    DRAWS.append((torch.rand(3), np.random.rand(3), random.random()))


def test_the_process_is_as_it_was():
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32 and torch.get_num_threads() == 1
    first, again = DRAWS
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]
'''


def test_a_test_that_leaves_the_process_changed_fails_and_the_next_sees_it_as_it_was(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import process_left_as_found  # noqa: F401\n")
    (tmp_path / "test_changing.py").write_text(CHANGING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=",
         "--rootdir", str(tmp_path), str(tmp_path / "test_changing.py")],
        cwd=tmp_path, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
    )
    out = done.stdout
    assert "6 passed, 3 errors" in out, out[-3000:]
    for test, change in (("gradients_left_off", "gradient mode True -> False"),
                         ("default_dtype_left_double", "default dtype torch.float32 -> torch.float64"),
                         ("threads_left_changed", "torch threads 1 -> 2")):
        assert f"ERROR test_changing.py::test_{test}" in out and change in out, out[-3000:]
