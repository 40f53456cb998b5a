"""`python -m recipes.prepare`: the public command; the tool is :mod:`recipes.tools.prepare`."""

import sys

from recipes.tools.prepare import main

if __name__ == "__main__":
    sys.exit(main())
