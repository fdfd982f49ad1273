"""NVIDIA FLARE compatibility: unmodified NVFlare Client API scripts as flare-airflow trainers.

* :mod:`.client` maps NVFlare 2.9's Client API (``import nvflare.client as flare``) onto
  flare-airflow's (:mod:`flare_airflow.core.client`): one process per (run, round, site), so
  ``is_running()`` is true until the site job's one ``send()``; NVFlare's data objects
  (``FLModel``, ``ParamsType``, ``FLMetaKey``) are :mod:`.fl_model`, what crosses between a
  script's objects and the update (torch, DIFF, metrics, meta) is :mod:`.convert`.
* ``shim/nvflare`` is a directory laid out as the ``nvflare`` package: ``nvflare.client``,
  ``nvflare.client.tracking``, ``nvflare.app_common.abstract.fl_model`` and the constant modules
  such scripts import. :mod:`.run` (``python -m flare_airflow.core.nvflare.run SCRIPT ARGS``)
  puts it first on the trainer's path and runs the script as ``__main__``.
* :mod:`.state_check` finds, in a script's source, what NVFlare's one-process-for-all-rounds shape
  keeps in memory across rounds and this project's one-process-per-round contract does not.

Pure Python (+ numpy through the Client API): it runs in a site image without Airflow or nvflare.
"""
