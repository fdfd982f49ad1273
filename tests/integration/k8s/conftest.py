"""The store-links tests' fixtures for pod sites that train through their links: the S3 emulator
(``s3``), every party's keys and a strict registry (``keys``)."""

from tests.integration.store.test_store_links import keys, s3  # noqa: F401
