"""Sensors: watch site jobs launched by another task, through the launcher spec."""
