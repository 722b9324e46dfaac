"""`harness serve` fuzzed from its own OpenAPI document (schemathesis), plus malformed
requests by hand: every answer is below 500, matches the document, and an error is
JSON with a one-line message."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from sandbox import server_fixture

# The session's server (shared with the other server tests).
sandbox_server = server_fixture.sandbox_server

pytestmark = pytest.mark.usefixtures("local_provider")  # the leak check of tests/conftest.py


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token}"}


def _document() -> dict:
    """The server's OpenAPI document, as create_app makes it (the live one is checked to be the same)."""
    from harness.sandbox.server import create_app

    return create_app(provider=None, token=None).openapi()  # type: ignore[arg-type]


# Loaded at import: schemathesis's lazy `from_fixture` does not run under pytest 9.
schema = schemathesis.openapi.from_dict(_document())


@pytest.fixture
def fuzz_cleanup(local_provider):
    """Sandboxes and snapshots the fuzzing makes are removed after each operation's test."""
    sandboxes = {i.id for i in local_provider.list()}
    snapshots = {s.name for s in local_provider.snapshots()}
    yield
    for info in local_provider.list():
        if info.id not in sandboxes:
            local_provider.get(info.id).delete()
    for snap in local_provider.snapshots():
        if snap.name not in snapshots:
            local_provider.delete_snapshot(snap.name)


def test_the_live_document_is_the_one_fuzzed(sandbox_server):
    live = httpx.get(f"{sandbox_server.url}/openapi.json", headers=auth(sandbox_server)).json()
    assert live == _document()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_outside_its_schema(case, sandbox_server, fuzz_cleanup):
    response = case.call(base_url=sandbox_server.url, headers=auth(sandbox_server), timeout=30)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"
    case.validate_response(response, headers=auth(sandbox_server))


# -- malformed requests by hand ---------------------------------------------------------


def one_line_error(response: httpx.Response, status: int | tuple[int, ...], kind: str | None = None) -> str:
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, (response.status_code, response.text[:300])
    err = response.json()["error"]
    assert set(err) == {"type", "message"} and err["message"] and "\n" not in err["message"], err
    assert len(err["message"]) <= 600 and "Traceback" not in err["message"]
    if kind:
        assert err["type"] == kind, err
    return err["message"]


@pytest.fixture
def live(sandbox_server, local_provider):
    """A client with the token, and one live sandbox to aim at."""
    with httpx.Client(base_url=sandbox_server.url, headers=auth(sandbox_server), timeout=60) as client:
        created = client.post("/v1/sandboxes", json={"spec": {"ttl_s": 600}})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            yield client, sid
        finally:
            local_provider.get(sid).delete()


def test_bodies_that_are_not_json_or_not_the_right_json(live):
    client, sid = live
    for body, headers in ((b"{not json", {"Content-Type": "application/json"}),
                          (b"\xff\xfe\x00", {"Content-Type": "application/json"}),
                          (b"[1, 2]", {"Content-Type": "application/json"}),
                          (b'{"command": "true"}', {"Content-Type": "text/plain"}),
                          (b"", {})):
        response = client.post(f"/v1/sandboxes/{sid}/exec", content=body, headers=headers)
        one_line_error(response, (400, 422), "ConfigError")
    assert "network" in one_line_error(client.post("/v1/sandboxes", json={"spec": {"network": "yes"}}), 422)
    assert "netwrok" in one_line_error(client.post("/v1/sandboxes", json={"spec": {"netwrok": True}}), 422)
    assert "command" in one_line_error(client.post(f"/v1/sandboxes/{sid}/exec", json={"command": 7}), 422)


def test_numbers_out_of_range(live):
    client, sid = live
    for timeout in (-1, 0, "soon"):
        one_line_error(client.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true", "timeout": timeout}), 422,
                       "ConfigError")
    # Python's JSON reads NaN and Infinity: they are no timeout and no TTL either.
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
        response = client.post(f"/v1/sandboxes/{sid}/exec", content=b'{"command": "true", "timeout": ' + literal + b"}",
                               headers={"Content-Type": "application/json"})
        one_line_error(response, 422, "ConfigError")
        response = client.post("/v1/sandboxes", content=b'{"spec": {"ttl_s": ' + literal + b"}}",
                               headers={"Content-Type": "application/json"})
        one_line_error(response, 422, "ConfigError")
    for value in (-1, 1 << 50, 1.5, "big", True):
        one_line_error(client.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true", "max_output_bytes": value}),
                       422)
    one_line_error(client.put(f"/v1/sandboxes/{sid}/files", params={"path": "f", "mode": -1}, content=b"x"), 422)
    one_line_error(client.put(f"/v1/sandboxes/{sid}/files", params={"path": "f", "mode": "rw"}, content=b"x"), 422)
    one_line_error(client.post(f"/v1/sandboxes/{sid}/exec", json={"command": "cat", "stdin": "not base64!"}), 400)


def test_unknown_routes_wrong_methods_and_ids_that_are_not_ids(live):
    client, sid = live
    assert "no route" in one_line_error(client.get("/v2/sandboxes"), 404, "NotFound")
    assert "no route" in one_line_error(client.get(f"/v1/sandboxes/{sid}/nope"), 404)
    response = client.request("PATCH", "/v1/sandboxes")
    one_line_error(response, 405, "MethodNotAllowed")
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
    response = client.put(f"/v1/sandboxes/{sid}")
    one_line_error(response, 405)
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"GET", "DELETE"}
    for bad in ("sb_0000000000", "..%2F..", "%00", "x" * 5000, "%F0%9F%92%A9", "%20"):
        response = client.get(f"/v1/sandboxes/{bad}")  # "../.." routes nowhere: NotFound, not SandboxNotFound
        assert one_line_error(response, (404, 422)) and response.json()["error"]["type"] in ("SandboxNotFound",
                                                                                              "NotFound")
        one_line_error(client.post(f"/v1/sandboxes/{bad}/exec", json={"command": "true"}), (404, 422))
        one_line_error(client.get(f"/v1/snapshots/{bad}"), 404, "SnapshotNotFound")
        one_line_error(client.delete(f"/v1/snapshots/{bad}"), 404, "SnapshotNotFound")  # was a 500
    for name in ("", "a/b", "..", "-x", "x" * 200, "a\u0000b"):
        assert "invalid snapshot name" in one_line_error(
            client.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": name}), (400, 422), "SandboxError")
        assert "invalid sandbox name" in one_line_error(
            client.post(f"/v1/sandboxes/{sid}/rename", json={"name": name}), (400, 422), "SandboxError")
    one_line_error(client.post("/v1/sandboxes", json={"spec": {"name": "a/b"}}), 422, "SandboxError")
    one_line_error(client.post("/v1/sandboxes", json={"spec": {"env": {"A=B": "x"}}}), 422, "ConfigError")
    one_line_error(client.get(f"/v1/sandboxes/{sid}/files", params={"path": ""}), 422, "SandboxFileError")


def test_huge_bodies_are_refused_and_the_server_stays_up(live, sandbox_server):
    from harness.sandbox._server_models import MAX_JSON_BYTES

    client, sid = live
    huge = b'{"command": "' + b"x" * (MAX_JSON_BYTES + 1) + b'"}'
    message = one_line_error(client.post(f"/v1/sandboxes/{sid}/exec", content=huge,
                                         headers={"Content-Type": "application/json"}), 413, "PayloadTooLarge")
    assert str(MAX_JSON_BYTES) in message

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(MAX_JSON_BYTES // (1 << 20) + 2):
            yield b"x" * (1 << 20)

    response = client.post(f"/v1/sandboxes/{sid}/exec", content=chunks(), headers={"Content-Type": "application/json"})
    one_line_error(response, (400, 413))
    # A command longer than the kernel takes as an argument: refused, not a 500.
    response = client.post(f"/v1/sandboxes/{sid}/exec", json={"command": "true " + "x" * (4 << 20)})
    assert response.status_code < 500, response.text[:300]
    assert client.get(f"/v1/sandboxes/{sid}").json()["id"] == sid  # still serving
