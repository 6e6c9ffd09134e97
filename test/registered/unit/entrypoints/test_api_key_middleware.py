"""ApiKeyMiddleware in isolation (Starlette TestClient, no processes): exact Bearer scheme, public routes."""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from sglite.srt.entrypoints.http_server import PUBLIC_PATHS, ApiKeyMiddleware

SUITE = "unit-cpu"
EST_TIME = 2


def make_client(key="s3cret"):
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS"])
    async def anything(path: str):
        return {"path": path}

    app.add_middleware(ApiKeyMiddleware, api_key=key)
    return TestClient(app)


def test_public_routes_are_exactly_health_and_metrics():
    assert PUBLIC_PATHS == {"/health", "/metrics"}
    c = make_client()
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    assert c.get("/health_generate").status_code == 401  # only the listed paths are public
    assert c.get("/health/").status_code == 401


def test_bearer_key_required_everywhere_else():
    c = make_client()
    for headers in ({}, {"Authorization": "s3cret"}, {"Authorization": "Bearer wrong"},
                    {"Authorization": "bearer s3cret"}, {"Authorization": "Bearer s3cret "}, {"Authorization": "Basic s3cret"}):
        r = c.post("/v1/completions", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["type"] == "AuthenticationError" and r.json()["code"] == 401
    assert c.post("/v1/completions", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_cors_preflight_is_not_blocked():
    assert make_client().options("/v1/chat/completions").status_code == 200
