"""``python -m bench ...``: the same as ``tfmx bench ...`` (see :mod:`bench.cli`).

Example (shell)::

    python -m bench --model mlp --rounds 3
"""

import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
