from __future__ import annotations

import pytest

from flare_airflow_testing.containers import build_images


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """Both images' tags (``trainer``, ``airflow``), built once per session when missing."""
    return build_images()
