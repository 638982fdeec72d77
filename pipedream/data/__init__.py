"""Training data: the built-in corpora and datasets (``datasets``), images (``images``), plugin datasets
(``plugins``), global batches and micro-batches (``batching``) and the pre-launch data checks."""
