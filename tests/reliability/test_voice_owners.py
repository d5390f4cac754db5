"""Uploaded voices have owners (issue 16, finding 6): per-owner quotas, deletion by the owner, an
admin listing, and owners that survive a restart. Other clients are simulated through a trusted
proxy's X-Forwarded-For."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import requests
import soundfile as sf

from moss_rt.protocol import Limits
from tests.helpers import error_of

KEY = "k" * 32
OTHER = {"X-Forwarded-For": "10.0.0.5"}  # another client, through the trusted proxy 127.0.0.1


def voice_wav(i: int) -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    sf.write(buf, (0.1 * rng.standard_normal(24000)).astype(np.float32), 24000, format="WAV")
    return buf.getvalue()


def upload(url: str, i: int, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(f"{url}/api/upload_ref", params={"ext": "wav"}, data=voice_wav(i), headers=headers)


def test_quota_per_owner_delete_by_owner_and_listing(fast_server, tmp_path: Path) -> None:
    srv = fast_server(limits=Limits(max_voices_per_owner=2), trusted_proxies=("127.0.0.1",))
    mine = [upload(srv.url, i).json()["ref_id"] for i in range(2)]
    # The legacy answer is unchanged: exactly these four fields.
    assert set(upload(srv.url, 0).json()) == {"ref_id", "duration", "frames", "name"}
    r = upload(srv.url, 2)
    assert r.status_code == 429 and error_of(r)["code"] == "rate_limited" and "max_voices_per_owner" in r.text
    # Another client has its own quota ...
    theirs = upload(srv.url, 3, OTHER).json()["ref_id"]
    # ... cannot delete my voices (nor learn they exist) ...
    r = requests.delete(f"{srv.url}/api/voices/{mine[0]}", headers=OTHER)
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    # ... and each client lists the built-ins and its own uploads only.
    listed = {v["id"]: v for v in requests.get(f"{srv.url}/api/voices").json()["voices"]}
    assert set(mine) <= set(listed) and theirs not in listed and all(listed[v]["owned"] for v in mine)
    assert "owner" not in listed[mine[0]]
    # Other clients' voices stay usable by id.
    assert requests.post(f"{srv.url}/api/stream", json={"text": "hi", "tokens": 2, "reference": theirs}).ok
    # The owner deletes one: it is gone (404 to use), and the quota has room again.
    r = requests.delete(f"{srv.url}/api/voices/{mine[0]}")
    assert r.status_code == 200 and r.json() == {"deleted": mine[0]}
    r = requests.post(f"{srv.url}/api/stream", json={"text": "hi", "reference": mine[0]})
    assert r.status_code == 404 and error_of(r)["field"] == "reference"
    assert requests.delete(f"{srv.url}/api/voices/{mine[0]}").status_code == 404
    assert upload(srv.url, 2).status_code == 200
    assert requests.delete(f"{srv.url}/api/voices/narrator").status_code == 404  # built-ins are not deletable
    # Its files are gone from the store.
    store = srv.state.settings.voices_store_dir
    assert not list(store.glob(f"{mine[0]}*"))


def test_admin_listing_needs_the_key_and_admin_may_delete_any(fast_server) -> None:
    srv = fast_server(api_key=KEY, trusted_proxies=("127.0.0.1",))
    auth = {"Authorization": f"Bearer {KEY}"}
    theirs = upload(srv.url, 1, {**auth, **OTHER}).json()["ref_id"]
    token = requests.post(f"{srv.url}/api/token", headers=auth).json()["token"]
    for headers in ({}, {"Authorization": f"Bearer {token}"}):
        r = requests.get(f"{srv.url}/api/admin/voices", headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "unauthorized"
    body = requests.get(f"{srv.url}/api/admin/voices", headers=auth).json()
    assert [(v["id"], v["owner"]) for v in body["voices"]] == [(theirs, "10.0.0.5")]
    assert body["owners"] == {"10.0.0.5": 1}
    assert requests.delete(f"{srv.url}/api/voices/{theirs}", headers=auth).status_code == 200
    assert requests.get(f"{srv.url}/api/admin/voices", headers=auth).json()["voices"] == []


def test_keyless_server_has_no_admin(fast_server) -> None:
    srv = fast_server()
    assert requests.get(f"{srv.url}/api/admin/voices").status_code == 401


def test_owners_survive_a_restart(server_process, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = server_process("--trusted-proxies", "127.0.0.1", data_dir=data)
    mine = upload(first.url, 1).json()["ref_id"]
    theirs = upload(first.url, 2, OTHER).json()["ref_id"]
    first.stop()
    second = server_process("--trusted-proxies", "127.0.0.1", data_dir=data)
    listed = [v["id"] for v in requests.get(f"{second.url}/api/voices").json()["voices"]]
    assert mine in listed and theirs not in listed
    assert requests.delete(f"{second.url}/api/voices/{theirs}").status_code == 404
    assert requests.delete(f"{second.url}/api/voices/{mine}").status_code == 200
    assert requests.delete(f"{second.url}/api/voices/{theirs}", headers=OTHER).status_code == 200


def test_voices_stored_before_owners_stay_listed_and_admin_deletable(fast_server, tmp_path: Path) -> None:
    srv = fast_server(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    ref = upload(srv.url, 7, auth).json()["ref_id"]
    store = srv.state.settings.voices_store_dir
    record = (store / f"{ref}.json").read_text()
    assert '"owner": "127.0.0.1"' in record
    # A record written before owners existed (no "owner"): loaded as unowned, listed to everyone.
    (store / f"{ref}.json").write_text(record.replace(', "owner": "127.0.0.1"', ""))
    import asyncio

    asyncio.run_coroutine_threadsafe(srv.state.voices.load(), srv.loop).result(10)
    assert ref in [v["id"] for v in requests.get(f"{srv.url}/api/voices", headers=auth).json()["voices"]]
    r = requests.delete(f"{srv.url}/api/voices/{ref}", headers={"Authorization": f"Bearer {KEY}", **OTHER})
    assert r.status_code == 200  # the admin deletes it


def test_the_owner_renames_an_uploaded_voice_and_the_name_is_kept(fast_server) -> None:
    """Issue 27 (8): PATCH /api/voices/<ref_id> {"name"} for the voice's owner (or the admin), validated, kept in
    the voice's record on disk; everyone else (and built-in voices) get 404 as for a voice that does not exist."""
    srv = fast_server(api_key=KEY, trusted_proxies=("127.0.0.1",))
    auth = {"Authorization": f"Bearer {KEY}"}
    token = requests.post(f"{srv.url}/api/token", headers=auth).json()["token"]
    mine = {"Authorization": f"Bearer {token}"}
    ref = upload(srv.url, 11, mine).json()["ref_id"]
    url = f"{srv.url}/api/voices/{ref}"
    r = requests.patch(url, json={"name": "  Old sailor  "}, headers=mine)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == ref and r.json()["name"] == "Old sailor" and r.json()["owned"] is True
    listed = {v["id"]: v for v in requests.get(f"{srv.url}/api/voices", headers=mine).json()["voices"]}
    assert listed[ref]["name"] == "Old sailor"
    # Kept in the voice's record on disk: a reload of the store (as after a restart) has the new name.
    import asyncio

    asyncio.run_coroutine_threadsafe(srv.state.voices.load(), srv.loop).result(10)
    assert srv.state.voices.get(ref).name == "Old sailor"
    assert srv.state.voices.get(ref).owner == "127.0.0.1"  # the owner is unchanged
    # Bad names and bodies: clear 4xx, nothing changed.
    for body, code, field in (
        ({"name": ""}, 422, "name"),
        ({"name": "   "}, 422, "name"),
        ({"name": "x" * 65}, 422, "name"),
        ({"name": "tab\there"}, 422, "name"),
        ({"name": 7}, 422, "name"),
        ({}, 422, "name"),
        ({"name": "ok", "owner": "me"}, 422, "owner"),
    ):
        r = requests.patch(url, json=body, headers=mine)
        assert r.status_code == code and error_of(r)["field"] == field, (body, r.text)
    r = requests.patch(url, data="name=x", headers={**mine, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    r = requests.patch(url, data="{not json", headers={**mine, "Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "bad_json"
    assert srv.state.voices.get(ref).name == "Old sailor"
    # Another client cannot rename it (nor learn it exists); built-ins and unknown ids are not renamable.
    other_token = requests.post(f"{srv.url}/api/token", headers={**auth, **OTHER}).json()["token"]
    r = requests.patch(url, json={"name": "mine now"}, headers={"Authorization": f"Bearer {other_token}", **OTHER})
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
    assert requests.patch(f"{srv.url}/api/voices/narrator", json={"name": "n"}, headers=mine).status_code == 404
    assert requests.patch(f"{srv.url}/api/voices/ref_{'0' * 24}", json={"name": "n"}, headers=mine).status_code == 404
    # The admin may rename any uploaded voice.
    r = requests.patch(url, json={"name": "Harbour master"}, headers={**auth, **OTHER})
    assert r.status_code == 200 and r.json()["name"] == "Harbour master"
