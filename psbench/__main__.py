import sys

from psbench.main import main

sys.exit(main())
