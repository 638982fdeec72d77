"""The errors a model, its data or its configuration can raise. They live in ``models`` (the layer
that everything else builds on) so model builders and the runtime raise the same classes, which
the entry points turn into one clear line (``pipedream.errors`` re-exports them)."""


class ConfigError(ValueError):
    """A configuration that cannot run: the message names the value, the rule and a way out."""


class DataError(ValueError):
    """Training data this run cannot use (e.g. a shape the schedule does not allow): the message
    says what was found and a way out."""
