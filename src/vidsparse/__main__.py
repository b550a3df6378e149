"""``python -m vidsparse`` runs the command-line tool."""

import sys

from vidsparse.cli import main

sys.exit(main())
