"""``python -m tfmx ...``: the same as the ``tfmx`` command (see :mod:`tfmx.cli`).

Example (shell)::

    python -m tfmx backends
"""

import sys

from tfmx.cli import main

if __name__ == "__main__":
    sys.exit(main())
