"""``python -m vidsparse.bench OP [OPTIONS]``: see ``vidsparse.bench.runner``."""

import sys

from vidsparse.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
