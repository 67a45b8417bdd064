"""`python -m psgrad` runs the command-line interface."""
import sys

from psgrad.cli.commands import main

sys.exit(main())
