"""The one exception type for bad user input: the CLI prints its message on one line and exits non-zero."""


class UserError(Exception):
    pass
