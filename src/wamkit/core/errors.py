"""Errors a user can act on. The CLI prints them as one line: a UserError exits with code 2, a RunError with 1."""


class UserError(Exception):
    """Bad input from the user (config, CLI, files): one clear line, no traceback, exit code 2."""


class RunError(Exception):
    """A run that cannot go on for a reason its message states in full (an episode that keeps crashing its env, a
    policy whose actions are unusable): one line naming what, no traceback, exit code 1."""


class ConfigError(UserError):
    """An unknown or malformed configuration key or value."""


def unknown_choice(kind: str, value: object, choices) -> UserError:
    """The one error for 'X is not one of the valid choices': names the valid choices."""
    valid = ", ".join(str(c) for c in choices)
    return UserError(f"unknown {kind} {value!r}; valid choices: {valid}")
