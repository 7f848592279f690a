"""The exceptions the CLI turns into one line: bad user input (exit 2) and a Ctrl-C (exit 130)."""


class UserError(Exception):
    """Bad input (config, checkpoint, dataset, request). The message names the fix."""


class Interrupted(Exception):
    """A command stopped by a Ctrl-C (SIGINT). The CLI prints "interrupted: " and the message
    (what was kept, how to go on) on one line and exits 130, the shell's code for a Ctrl-C."""


def first_line(e: BaseException) -> str:
    """`e`'s message's first line (its type's name where it has none): for a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
