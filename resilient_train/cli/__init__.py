"""The command line: `resilient-train` (main.py) and its subcommands."""
