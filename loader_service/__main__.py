import sys

from loader_service.cli import main

sys.exit(main())
