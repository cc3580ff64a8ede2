"""``python3 -m loom.deepspeed``: see :mod:`loom.deepspeed`."""
import sys

from ._cli import main

sys.exit(main())
