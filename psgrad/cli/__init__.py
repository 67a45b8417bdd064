"""The `psgrad` command line: argv -> validated config -> call."""
