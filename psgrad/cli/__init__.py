"""The `psgrad` command line: argv -> validated config -> call (main.py is the entry point)."""
