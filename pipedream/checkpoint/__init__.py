"""Checkpoints: saving and resuming (``store``, torch DCP), their integrity record, and the shapes a
checkpoint expects (checked before launch); its torch files are read as data only (``plain``)."""
