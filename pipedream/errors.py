"""Errors that the entry points turn into one clear line and a non-zero exit."""


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the value, the rule and a way out."""
