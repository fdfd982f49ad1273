"""``python -m flare_airflow.site_task``: the command a site task runs (:func:`.runner.main`)."""

import os
import sys

from flare_airflow.site_task.runner import main

code = main()
# Nothing is left to clean up (the trainer's group is gone, the lease released, the files
# closed): skip the interpreter's teardown of numpy & co., ~20 ms of every site job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
