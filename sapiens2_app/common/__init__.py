"""What every command shares: the command-line rules (cli), run reports, crash-safe file writes, version facts and
the table of output files. Imports only the library (sapiens2, ...)."""
