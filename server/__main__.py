"""`python -m server ...` is `pagedserve ...`."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
