"""scikit-learn's handwritten digits for the example and drill workers, read without importing scikit-learn.

The workers restart on every fault, so their start-up is part of every recovery measured: importing
``sklearn.datasets`` cost ~1.4 s of CPU per worker (a tenth of a small job's start), for one 1,797-row CSV that
scikit-learn ships in its package data. This reads that file directly; the arrays are the ones
``sklearn.datasets.load_digits(return_X_y=True)`` returns (same values, same dtypes).
"""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np


def digits_path() -> str | None:
    """Where scikit-learn's ``digits.csv.gz`` is, found without running scikit-learn's ``__init__``; None when
    scikit-learn is not installed or keeps the file elsewhere."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    return path if os.path.isfile(path) else None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as ``(images, labels)``: float64 of shape (1797, 64) with values 0-16, and int labels 0-9.

    Falls back to ``sklearn.datasets.load_digits`` where the data file is not found (another layout).

    Raises:
        SystemExit: scikit-learn is not installed (the workers' data comes with it).
    """
    path = digits_path()
    if path is None:
        try:
            from sklearn.datasets import load_digits as sklearn_digits
        except ImportError:
            raise SystemExit("the example and drill workers need scikit-learn's digits data: pip install "
                             "scikit-learn") from None
        return sklearn_digits(return_X_y=True)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)
