"""The command line: the Typer app, shared options, one module per command. The lazy boundary: nothing here imports torch at import time."""
