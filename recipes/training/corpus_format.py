"""What a prepared corpus is made of, shared by its writer (``recipes.prepare``) and its reader
(:mod:`recipes.training.data`) without importing torch: the token dtypes a corpus may be stored in,
and the error a bad corpus or input raises."""

from __future__ import annotations

import numpy as np

#: ``--dtype`` / ``meta.json``'s ``dtype``: the token file's element type
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """Missing or malformed data; the message says what is wrong, then (after "; ") what to run."""
