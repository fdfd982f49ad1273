"""Moving in from NVIDIA FLARE: the job-folder importer (``flare-airflow import-nvflare``).

The Client API compatibility layer the imported jobs run with lives in the core
(:mod:`flare_airflow.core.nvflare`): it runs in site images, where this package's dependencies
(the job configuration layer, pyhocon) need not be installed.
"""
