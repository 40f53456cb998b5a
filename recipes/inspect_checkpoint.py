"""`python -m recipes.inspect_checkpoint`: the public command; the tool is :mod:`recipes.tools.inspect_checkpoint`."""

import sys

from recipes.tools.inspect_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
