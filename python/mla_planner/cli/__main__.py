import sys

from mla_planner.cli import main

sys.exit(main())
