"""Aggregation: one round's verified site updates in, the next global model and the round's tally out.

Airflow-free; the aggregation operator (``operators/aggregate.py``) is a thin call into it. The rooms:

- :mod:`.update_reader`: what an update must be to count, and the reader that verifies each one
  (size, digests against the site task's pin, strict safetensors) before any maths sees it;
- :mod:`.accumulate`: the float64 multiply-add every mean shares (pure numpy, no I/O);
- :mod:`.tally`: the one round tally every rule keeps (accepted, rejected, weighted metrics);
- :mod:`.streaming`: streaming FedAvg (memory of one global model, whatever the number of sites);
- :mod:`.strategies`: one module per rule or server optimizer, behind the seam in ``strategies/base.py``;
- :mod:`.engine`: :func:`~.engine.aggregate_from_store`, which feeds any strategy verified reads;
- :mod:`.central_dp`: central differential privacy as a wrapper around any strategy;
- :mod:`.round`: the round's inputs (which site's update counts, and why not) and its server state;
- :mod:`.round_output`: what the round leaves behind -- its writes, in their order, and its summary.

The package's ``__init__`` imports nothing: the site task loads only the reader it checks updates with.
"""
