import sys

from inferq.cli import main

sys.exit(main())
