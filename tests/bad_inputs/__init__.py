"""The bad-input battery: every hostile or careless input the project is tested against.

Each category has one module ``test_<category>.py`` holding ``CASES`` (a list of :class:`Case`)
and the tests that run them. ``docs/bad-inputs.md`` is generated from all ``CASES``
(``python -m tests.bad_inputs.table``) and ``test_table.py`` fails when it is stale, so every row
of the table is a test.
"""
