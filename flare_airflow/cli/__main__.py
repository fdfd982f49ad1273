"""``python -m flare_airflow.cli``: the ``flare-airflow`` command without the console script."""

from __future__ import annotations

from flare_airflow.cli.commands import console

console()
