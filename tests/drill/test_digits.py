"""The example and drill workers' digits: scikit-learn's own arrays, read without importing scikit-learn."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from trainguard.drill.digits import load_digits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_arrays_are_scikit_learns():
    """Same values and dtypes as ``sklearn.datasets.load_digits(return_X_y=True)``: a resumed run's bitwise
    equality with the reference rests on every process seeing the same data."""
    from sklearn.datasets import load_digits as sklearn_digits

    x, y = load_digits()
    sx, sy = sklearn_digits(return_X_y=True)
    assert x.dtype == sx.dtype and y.dtype == sy.dtype
    assert np.array_equal(x, sx) and np.array_equal(y, sy)
    assert x.shape == (1797, 64)


def test_the_example_job_loads_its_data_without_importing_scikit_learn():
    """``examples/train.py``'s data comes without scikit-learn's import (~1.4 s of CPU at every worker start)."""
    code = ("import sys; sys.path.insert(0, 'examples'); import train; x, y, tx, ty = train.load_data(0); "
            "print(len(x), len(tx), 'sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1500", "297", "False"], done.stdout
