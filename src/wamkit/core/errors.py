"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, CLI, files): one clear line, no traceback, exit code 2."""


class ConfigError(UserError):
    """An unknown or malformed configuration key or value."""


def unknown_choice(kind: str, value: object, choices) -> UserError:
    """The one error for 'X is not one of the valid choices': names the valid choices."""
    valid = ", ".join(str(c) for c in choices)
    return UserError(f"unknown {kind} {value!r}; valid choices: {valid}")
