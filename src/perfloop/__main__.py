import sys

from perfloop.cli import main

sys.exit(main())
