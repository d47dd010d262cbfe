import sys

from psserver.main import main

sys.exit(main())
