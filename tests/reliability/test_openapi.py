"""The OpenAPI document is accurate: it lists every HTTP route, and schemathesis finds no 5xx and no
response that breaks the document, on positive and negative (schema-violating) inputs."""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from moss_rt.protocol import Limits
from moss_rt.web.openapi import documented_operations, served_operations
from tests.helpers import error_of

EXAMPLES_PER_OPERATION = 25
BUDGET_SEC = 60.0


def test_document_lists_every_http_route(fast_server, tmp_path) -> None:
    """What the service serves (every method of every route) is what its document describes."""
    from moss_rt.config import Settings
    from moss_rt.web.app import create_app
    from tests.web.conftest import scripted

    settings = Settings(data_dir=tmp_path / "d", voices_dir=tmp_path / "v")
    served = served_operations(create_app(settings, scripted(settings)))
    assert {("get", "/api/takes/{take_id}.wav"), ("patch", "/api/sessions/{session_id}/takes/{take_id}")} <= served
    srv = fast_server()
    doc = requests.get(f"{srv.url}/api/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert documented_operations(doc) == served, served ^ documented_operations(doc)
    # Bounds come from the running limits, not from a copy.
    body = doc["paths"]["/api/stream"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["text"]["maxLength"] == Limits().max_text_chars
    assert body["properties"]["chunk_frames"]["maximum"] == Limits().max_chunk_frames


@pytest.mark.slow  # started first in parallel runs (tests/conftest.py)
def test_schemathesis_against_the_running_server(fast_server, tmp_path) -> None:
    # One client sends every request: per-client caps would answer most of them 429.
    srv = fast_server(
        frame_ms=1.0, limits=Limits(max_new_tokens=16), max_takes_per_client=0, http_requests_per_sec=0.0
    )
    # A stored voice and a finished take give the generators something real to find.
    requests.post(f"{srv.url}/api/upload_ref?ext=wav", data=_wav())
    schema = schemathesis.openapi.from_url(f"{srv.url}/api/openapi.json")
    deadline = time.monotonic() + BUDGET_SEC
    failures: list[str] = []
    tested = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                if time.monotonic() > deadline:
                    return
                response = case.call(base_url=srv.url, timeout=30)
                assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
                # Schema-valid is not always acceptable here: random bytes match "binary" but are not
                # audio, "\x1c" matches the text pattern but is blank to Python. Those 4xx are right.
                case.validate_response(response, excluded_checks=[positive_data_acceptance])

            try:
                check()
                tested += 1
            except Unsatisfiable:
                pass  # nothing to break: an operation without parameters has no negative inputs
            except Exception as exc:  # collect all, report together
                failures.append(f"{operation.label} [{mode.value}]: {str(exc)[:800]}")
    assert tested > 0
    assert not failures, "\n\n".join(failures)
    assert requests.get(f"{srv.url}/healthz").status_code == 200


def test_undocumented_methods_and_paths_are_json_4xx(fast_server) -> None:
    srv = fast_server()
    r = requests.put(f"{srv.url}/api/voices")
    assert r.status_code == 405 and error_of(r)["code"] == "bad_message"
    r = requests.get(f"{srv.url}/api/does/not/exist")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def _wav() -> bytes:
    from tests.conftest import sine_wav

    return sine_wav(seconds=1.0, sr=16000)
