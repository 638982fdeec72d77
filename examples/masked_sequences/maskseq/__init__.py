"""A user's own model and data set, trained by pipedream as plugins (see ../README.md)."""
