"""Sites on Airflow Edge workers without a shared secret (issue 36, control plane).

- :mod:`.middleware`: the API server's check of every site request (an Airflow plugin middleware):
  worker API calls only for the site's own worker, queues and jobs; Execution-API secrets only as
  the registry grants them to a site's tasks.
- :mod:`.verifier`: edge3's ``[edge] jwt_verifier``: only site worker tokens act as Edge workers.
- :mod:`.worker`: ``flare-airflow site worker SITE``: edge3's worker signing with the site's key.
- :mod:`.plugin`: the Airflow plugin that installs the middleware.

See docs/deploy-across-sites.md and docs/threat-model.md.
"""
