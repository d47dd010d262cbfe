import sys

from psworker.main import main

sys.exit(main())
