"""``python -m benchmarks``: the whole side-by-side suite (see :mod:`benchmarks.run`)."""

from .run import main

main()
