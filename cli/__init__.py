"""The conductor-run command line: the only place that parses flags, prints, and picks exit codes."""
