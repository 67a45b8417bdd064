"""`python -m psgrad` runs the command-line interface."""
from psgrad.cli.main import entry

entry()
