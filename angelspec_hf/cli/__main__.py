"""`python -m angelspec_hf.cli` (as `make demo` runs it): the `angelspec` command."""

import sys

from . import main


sys.exit(main())
