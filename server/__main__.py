"""`python -m server ...` is `pagedserve ...`."""

import sys

from server.http.cli import main

if __name__ == "__main__":
    sys.exit(main())
