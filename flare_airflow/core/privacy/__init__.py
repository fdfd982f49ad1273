"""Privacy: the site's update filters, central DP's maths and the privacy accountant.

Pure Python + numpy, no Airflow:

- :mod:`.accountant`: the exact Gaussian-DP account (Dong, Roth & Su) of the Gaussian mechanism
  with full participation: ε at a δ after T rounds, the rounds a budget allows, z for a target ε.
- :mod:`.filters`: what a site applies to its update before it leaves: one class per filter
  (exclude_vars, clip, gaussian, percentile) in the ``FILTERS`` registry, noise keyed to (job, run,
  round, site) and the clipped update released.
- :mod:`.central`: central DP's aggregation step (clip each update, noise the sum, fixed
  denominator), noise keyed to the round and the accepted set.
- :mod:`.ledger`: the site's privacy odometer, every distinct release in a SQLite file at the site.
- :mod:`.secret`: refuse a noise secret too weak to keep the noise from being guessed.
"""
