"""`python -m lenses.cli ...` (and `torchrun -m lenses.cli ...`) runs the `lenskit` command."""

import sys

from . import main

sys.exit(main())
