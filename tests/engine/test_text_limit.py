"""The advertised text limit is reachable: a text of ``max_text_chars`` characters fits the default cache."""

from __future__ import annotations

import requests

from moss_rt.config import Settings
from moss_rt.protocol import Limits
from tests.helpers import parse_frames


def ascii_noise(n: int) -> str:
    """Printable ASCII that merges badly: about one token per character, the costliest text."""
    return "".join(chr(33 + (i * 7919) % 94) for i in range(n))


def test_a_text_at_the_character_limit_fits_the_default_cache(moss_server) -> None:
    srv = moss_server(max_seq_len=Settings().max_seq_len)  # the default cache (the fixture shrinks it)
    limit = Limits().max_text_chars
    r = requests.post(f"{srv.url}/api/stream", json={"text": ascii_noise(limit), "max_new_tokens": 2}, timeout=300)
    assert r.status_code == 200, r.text
    assert parse_frames(r.content)[-1][1]["type"] == "end"
    # One character more is refused by the character limit, and the answer names it.
    r = requests.post(f"{srv.url}/api/stream", json={"text": ascii_noise(limit + 1)}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "text"
    assert f"the limit is {limit}" in r.json()["error"]["message"]
