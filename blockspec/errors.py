"""The error every user-facing check raises."""


class ConfigError(ValueError):
    """A user-facing configuration problem: the CLI prints it as one line, no traceback."""
