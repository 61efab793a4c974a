"""The command line: main plus one module per command. Imports nothing heavy at the top."""
