"""`python -m psgrad` runs the command-line interface."""
import sys

from psgrad.cli.main import main

sys.exit(main())
