"""The site task's service: what runs around a site job's trainer, on every backend.

Not a backend (those are in :mod:`flare_airflow.launchers`): it verifies the input global model,
runs the trainer through the process launcher, checks and publishes the update, claims tries,
watches its owners and writes failure records. No Airflow import: it runs as
``python -m flare_airflow.site_task`` beside the trainer, and the Airflow operators call it.

- :mod:`.spec`: :class:`SiteRun`, the site task's spec, and the environment names that carry it.
- :mod:`.build`: the one builder of a :class:`SiteRun` (site tasks, sensors, evaluation, try-trainer).
- :mod:`.checks`: the input-model and update checks, publishing, failure records.
- :mod:`.tries`: try claims; only the latest try of a site job publishes.
- :mod:`.owners`: the job ends with its owner processes and leaves no descendant.
- :mod:`.runner`: :func:`run_site` and the command's :func:`main`.
"""
