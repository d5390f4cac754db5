"""The OpenAPI document (moss_rt/web/openapi.json, filled in by moss_rt/web/openapi.py) against what it describes:
the app's routes, the protocol's field table, the limits, and the typed definitions of the bodies.

No server: the app is built and its route table read. tests/reliability/test_openapi.py drives a running server
with the document (schemathesis).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from moss_rt.align.base import WordTime
from moss_rt.config import Settings
from moss_rt.formats import FORMATS, AudioFormat
from moss_rt.protocol import ErrorCode, Limits, ProtocolError, SessionResumed, http_error_body, stream_fields
from moss_rt.web import openapi
from moss_rt.web.app import create_app
from tests.web.conftest import scripted


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("openapi")
    settings = Settings(data_dir=root / "d", voices_dir=root / "v")
    return create_app(settings, scripted(settings))


def filled(limits: Limits | None = None) -> dict[str, Any]:
    document: dict[str, Any] = openapi.fill(openapi._template(), limits or Limits())
    return document


def schema(document: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = document["components"]["schemas"][name]
    return found


def test_every_route_is_documented_and_every_documented_operation_served(app: Any) -> None:
    served = openapi.served_operations(app)
    documented = openapi.documented_operations(filled())
    assert len(served) > 40
    assert served - documented == set(), "routes without a description in openapi.json"
    assert documented - served == set(), "openapi.json describes operations the app does not serve"
    # What the service sends is what it serves: nothing filtered away from the full app.
    assert openapi.documented_operations(openapi.openapi_document(app)) == served


def test_every_placeholder_is_filled() -> None:
    text = json.dumps(filled())
    assert '"$limit"' not in text and '"$derived"' not in text and '"$const"' not in text
    assert "{limits." not in text


def test_limits_come_from_the_running_service() -> None:
    limits = Limits(max_text_chars=321, max_upload_bytes=4321, max_script_lines=9)
    document = filled(limits)
    upload = document["paths"]["/api/upload_ref"]["post"]["description"]
    assert upload.startswith("At most 4321 bytes")
    script = document["paths"]["/api/scripts"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert script["properties"]["lines"]["maxItems"] == 9
    align = document["paths"]["/api/align"]["post"]["parameters"][0]["schema"]
    assert align["maxLength"] == 321  # the smaller of max_text_chars and what a request line holds
    assert filled()["paths"]["/api/align"]["post"]["parameters"][0]["schema"]["maxLength"] == 500


@pytest.mark.parametrize(
    "node",
    [{"$limit": "max_nothing"}, {"$const": "nothing"}, {"$derived": "nothing"}, "at most {limits.max_nothing}"],
)
def test_a_placeholder_naming_nothing_is_an_error(node: Any) -> None:
    with pytest.raises(openapi.DocumentError):
        openapi.fill({"x": node}, Limits())


def test_the_stream_request_is_the_protocols_field_table() -> None:
    limits = Limits()
    body = filled()["paths"]["/api/stream"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    table = openapi.stream_request_fields(limits)
    assert set(body["properties"]) == set(table)
    for name, field in table.items():
        prop = body["properties"][name]
        assert prop.get("maxLength") == field.max_length, name
        if field.maximum is not None:
            assert prop["maximum"] == field.maximum, name
        if field.choices is not None:
            assert prop["enum"] == list(field.choices), name
    speech = filled()["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(openapi.SPEECH_EXTRA_FIELDS) <= set(speech["properties"]) and set(openapi.SPEECH_EXTRA_FIELDS) <= set(
        stream_fields(limits)
    )


def test_bodies_match_their_typed_definitions() -> None:
    document = filled()
    # Word timing: WordTime's wire form.
    word = schema(document, "Word")
    plain, flagged = WordTime("hi", 0.1, 0.2).to_dict(), WordTime("hi", 0.1, 0.2, flags=("interpolated",)).to_dict()
    assert set(word["required"]) == set(plain) and set(word["properties"]) == set(flagged)
    assert schema(document, "TakeWords")["properties"]["words"]["items"] == {"$ref": "#/components/schemas/Word"}
    # A stored session, over HTTP: the fields of the session message that answers resume.
    session = schema(document, "Session")
    fields = {f.name for f in dataclasses.fields(SessionResumed)}
    assert set(session["properties"]) <= fields and set(SessionResumed.required) <= set(session["required"])
    # Errors: what http_error_body writes, with every code.
    error = schema(document, "Error")["properties"]["error"]
    body = http_error_body(ProtocolError(ErrorCode.INVALID_FIELD, "bad", field="text"))["error"]
    assert set(error["properties"]) == set(body) and set(error["required"]) <= set(body)
    assert error["properties"]["code"]["enum"] == [code.value for code in ErrorCode]
    # A take's audio in any delivery format.
    download = document["paths"]["/api/takes/{take_id}.wav"]["get"]["responses"]["200"]["content"]
    assert set(download) == {AudioFormat(name).media_type for name in FORMATS}


def test_the_document_file_is_valid_json_with_no_stray_markers() -> None:
    text = Path(openapi.__file__).with_name("openapi.json").read_text(encoding="utf-8")
    template = json.loads(text)

    def markers(node: Any) -> set[str]:
        if isinstance(node, dict):
            own = {key for key in node if key.startswith("$") and key != "$ref"}
            return own.union(*(markers(v) for v in node.values()))
        if isinstance(node, list):
            return set().union(*(markers(v) for v in node))
        return set()

    assert markers(template) <= {"$limit", "$const", "$derived"}
