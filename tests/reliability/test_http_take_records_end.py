"""Issue 23, finding 7: HTTP takes whose client left stayed "running" in the take store forever.

The engine slot was freed, but the take's record was not ended; running records are never evicted, so after
1,094 disconnects the store held 1,102 records against its cap of 1,024. Now the record of an HTTP take ends
(``cancelled``) when its client leaves, on ``POST /api/stream`` and on ``/v1/audio/speech``, and the cap holds.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable

import pytest
import requests

from moss_rt.session import RecentTakes, TakeStatus
from tests.helpers import RunningServer, run, wait_until
from tests.reliability.conftest import raw_http, read_head

CAP = 8  # the take store's cap in this test (1024 in service): a few times more disconnects than that
DISCONNECTS = 30


def abort(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/stream", {"text": "a long line", "tokens": 400, "max_new_tokens": 400}),
        ("/v1/audio/speech", {"input": "a long line", "voice": "none", "response_format": "pcm", "tokens": 400,
                              "max_new_tokens": 400}),
    ],
)
def test_the_take_store_cap_holds_after_many_clients_leave_mid_take(
    fast_server: Callable[..., RunningServer], path: str, body: dict[str, object]
) -> None:
    server = fast_server(http_requests_per_sec=0.0)
    store = server.state.takes = RecentTakes(capacity=CAP)  # every take from here on is recorded in it
    data = json.dumps(body)
    for _ in range(DISCONNECTS):
        sock = raw_http(
            server.state.settings.port,
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n{data}",
        )
        status, _ = read_head(sock)
        assert status == 200
        sock.recv(4096)  # its first audio: the take is streaming
        abort(sock)

    def settled() -> bool:
        takes = list(store._takes.values())
        return not server.state.http_takes and all(t.status is TakeStatus.ENDED for t in takes)

    async def wait() -> None:
        await wait_until(settled, within=10)

    run(wait())
    assert {t.reason for t in store._takes.values()} == {"cancelled"}
    # The store evicts when a take is added: one more, heard to its end, and the store is within its cap.
    short = json.dumps({**body, "tokens": 2, "max_new_tokens": 2})
    answer = requests.post(server.url + path, data=short, headers={"Content-Type": "application/json"}, timeout=10)
    assert answer.status_code == 200
    assert len(store) <= CAP, len(store)
