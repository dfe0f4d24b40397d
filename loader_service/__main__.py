import sys

from loader_service.tools.cli import main

sys.exit(main())
