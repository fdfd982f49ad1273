"""The directory the compatibility runner puts on the trainer's path: its ``nvflare`` is the stand-in.

A package only so that it ships with flare-airflow; nothing imports it under this name.
"""
