import sys

from benchmarks.cli import main

# The guard matters: (b) spawns trainer processes, which import this module as ``__mp_main__``.
if __name__ == "__main__":
    sys.exit(main())
