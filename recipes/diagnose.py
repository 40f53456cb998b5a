"""`python -m recipes.diagnose`: the public command; the tool is :mod:`recipes.tools.diagnose`."""

import sys

from recipes.tools.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
