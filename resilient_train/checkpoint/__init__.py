"""Checkpointing: storage, commit protocol, retention and restore."""
