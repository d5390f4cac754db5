"""Issue 23, finding 1: a client that drops its connection mid-take with a delivery format must not crash
the server (PyAV's container was closed by one thread while another was still encoding into it).

The server runs in its own process (a SIGSEGV there must fail this test, not kill the test run), and the
client aborts its TCP connection with a reset right after the first encoded frames arrive, as the red team did.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import requests

from tests.reliability.conftest import raw_http, raw_ws_connect, read_head, ws_client_frame

ATTEMPTS = 12


def abort(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), not an orderly FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_until_audio(sock: socket.socket, tag2_frames: int) -> None:
    """Read server WebSocket frames until ``tag2_frames`` binary frames of encoded audio (tag 2) arrived."""
    seen = 0
    buf = b""
    while seen < tag2_frames:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        buf += chunk
        while len(buf) >= 2:
            opcode, n = buf[0] & 0x0F, buf[1] & 0x7F
            head = 2
            if n == 126:
                if len(buf) < 4:
                    break
                n, head = struct.unpack(">H", buf[2:4])[0], 4
            elif n == 127:
                if len(buf) < 10:
                    break
                n, head = struct.unpack(">Q", buf[2:10])[0], 10
            if len(buf) < head + n:
                break
            payload, buf = buf[head : head + n], buf[head + n :]
            if opcode == 0x2 and payload[:1] == b"\x02":
                seen += 1


def test_dropping_a_formatted_websocket_take_keeps_the_server_alive(server_process) -> None:
    # Frames as fast as the encoder takes them, in chunks of 20: an encode is in flight most of the time.
    proc = server_process("--frame-ms", "1", "--max-lead-sec", "0")
    for fmt in ["mp3", "opus", "aac", "flac"] * (ATTEMPTS // 4):
        sock = raw_ws_connect(proc.port)
        start = {"type": "start", "text": "hello " * 20, "max_new_tokens": 1000, "chunk_frames": 20, "format": fmt}
        sock.sendall(ws_client_frame(json.dumps(start).encode()))
        read_until_audio(sock, 3)
        abort(sock)
        time.sleep(0.02)
    assert proc.proc is not None and proc.proc.poll() is None, "the server died"
    assert requests.get(proc.url + "/readyz", timeout=5).status_code == 200


def test_dropping_an_openai_speech_request_keeps_the_server_alive(server_process) -> None:
    proc = server_process("--frame-ms", "1", "--max-lead-sec", "0")
    body = json.dumps(
        {"model": "v2-best", "input": "hello " * 50, "voice": "none", "response_format": "mp3", "chunk_frames": 20}
    )
    for _ in range(ATTEMPTS):
        sock = raw_http(
            proc.port,
            f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{proc.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}",
        )
        status, _ = read_head(sock)
        assert status == 200
        sock.recv(4096)  # the first encoded bytes
        abort(sock)
        time.sleep(0.05)  # the next request must not meet this one's per-client slot
    assert proc.proc is not None and proc.proc.poll() is None, "the server died"
    assert requests.get(proc.url + "/readyz", timeout=5).status_code == 200
