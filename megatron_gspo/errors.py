"""The one exception type for bad user input: the CLI prints its message on one line, exits 2."""


class UserError(Exception):
    """Bad input (config, checkpoint, dataset, request). The message names the fix."""
