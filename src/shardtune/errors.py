"""The one exception type that means "the user asked for something we can't do"."""

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input. The CLI prints it as a single line and exits with code 2, no traceback.

    The message should name the problem and the fix.
    """
