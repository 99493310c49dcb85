"""Errors that mean "the user's input is wrong", as opposed to a bug.

The CLI turns a ``UserError`` into one line on stderr and exit code 2; library code
raises it with a message that says what is wrong and what to do instead.
"""


class UserError(Exception):
    """Bad input (flag, config file, data, checkpoint, environment) with a fix in its message."""


class ConfigError(UserError, ValueError):
    """A configuration value or file that cannot be used."""
