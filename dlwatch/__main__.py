import sys

from dlwatch.cli import main

sys.exit(main())
