import sys

from gpu_worker.cli import main

sys.exit(main())
