from __future__ import annotations

from collections.abc import Iterator

import pytest

from flare_airflow_testing.containers import build_images, docker_api


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """Both images' tags (``trainer``, ``airflow``), built once per session when missing."""
    return build_images()


@pytest.fixture(scope="session")
def docker_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``DOCKER_HOST`` of podman's Docker-compatible API, started once per session: the docker CLI
    drives the same engine (no Docker engine on these machines), so ``engine: docker`` runs for real."""
    with docker_api(tmp_path_factory.mktemp("docker-api")) as env:
        yield env
