"""``python -m torch_opaque inspect FILE [--graph OUT]`` (see torch_opaque/cli/)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
