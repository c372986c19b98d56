"""The router's API key counts only as a bearer token: the right key under another
scheme, or with no scheme at all, is refused like a wrong one; the scheme's case and
spaces around the key do not matter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from splitserve_worker.router.app import create_app
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery, parse_static
from splitserve_worker.router.service import RouterService

pytestmark = pytest.mark.unit

KEY = "s3cret"


@pytest.fixture(scope="module")
def client(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))
    config = RouterConfig(model_name="tiny", max_model_len=256, api_key=KEY)
    disc = StaticDiscovery(parse_static("decode=127.0.0.1:9"))  # nobody listens: no worker
    with TestClient(create_app(RouterService(config, tokenizer, disc))) as c:
        yield c


@pytest.mark.parametrize(
    "header",
    [
        f"Basic {KEY}",  # sorts before "bearer"
        f"Token {KEY}",  # sorts after it
        f"Bearerx {KEY}",
        KEY,  # no scheme
        f"{KEY} Bearer",
        "Bearer",
        f"Bearer {KEY}x",
    ],
)
def test_the_key_under_another_scheme_is_refused(client: TestClient, header: str) -> None:
    r = client.get("/v1/models", headers={"Authorization": header})
    assert r.status_code == 401, (header, r.text)
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY} "])
def test_the_bearer_key_is_accepted_whatever_the_schemes_case(
    client: TestClient, header: str
) -> None:
    assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200
