"""Triggers: serialisable, emit typed events."""
