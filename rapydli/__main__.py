"""``python -m rapydli`` runs the command line."""

import sys

from rapydli.cli import main

sys.exit(main())
