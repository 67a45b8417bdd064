"""`python -m psgrad` runs the command-line interface."""
import sys

from psgrad.cli import main

sys.exit(main())
