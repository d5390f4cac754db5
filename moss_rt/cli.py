"""Command line: ``moss-rt serve | say | make-tiny`` (also ``python -m moss_rt ...``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from moss_rt.config import Settings, settings_from_env

log = logging.getLogger("moss_rt")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )


def build_engine(settings: Settings):  # type: ignore[no-untyped-def]
    """The engine named by settings (imported lazily: the scripted one needs no torch)."""
    if settings.engine == "scripted":
        from moss_rt.engine.scripted import ScriptedEngine

        return ScriptedEngine(
            frame_ms=settings.frame_ms,
            max_slots=settings.max_slots,
            max_queue=settings.max_queue,
            max_lead_sec=settings.max_lead_sec,
        )
    if settings.engine == "moss":
        from moss_rt.engine.moss import MossEngine

        return MossEngine(settings)
    raise SystemExit(f"unknown engine {settings.engine!r} (moss or scripted)")


# --------------------------------------------------------------------------- serve


def add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the service (env MOSS_RT_<FLAG> sets defaults)")
    base = settings_from_env()
    p.add_argument("--host", default=base.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=base.port, help="port to listen on (default %(default)s)")
    p.add_argument(
        "--engine",
        choices=("moss", "scripted"),
        default=base.engine,
        help="moss: the real model (or the tiny demo); scripted: the deterministic test engine (default %(default)s)",
    )
    p.add_argument("--model", default=base.model, help="auto | tiny | PATH | HUB_ID (default %(default)s)")
    p.add_argument("--codec", default=base.codec, help="auto | tiny | PATH | HUB_ID (default %(default)s)")
    p.add_argument("--device", default=base.device, help="auto | cpu | cuda | cuda:N (default %(default)s)")
    p.add_argument("--dtype", default=base.dtype, help="auto | float32 | bfloat16 (default %(default)s)")
    p.add_argument("--data-dir", type=Path, default=base.data_dir, help="uploaded voices, tiny models")
    p.add_argument("--voices-dir", type=Path, default=base.voices_dir, help="built-in voices (audio files)")
    p.add_argument("--max-slots", type=int, default=base.max_slots, help="takes generating at once")
    p.add_argument(
        "--max-queue", type=int, default=base.max_queue, help="takes waiting for a slot (beyond: busy)"
    )
    p.add_argument(
        "--max-lead-sec",
        type=float,
        default=base.max_lead_sec,
        help="audio a client may hold unplayed before its take is paused (0: no pacing)",
    )
    p.add_argument("--max-seq-len", type=int, default=base.max_seq_len, help="cache positions per slot")
    p.add_argument("--heard-audio-mb", type=int, default=base.heard_audio_mb, help="streamed PCM kept for replays")
    p.add_argument("--frame-ms", type=float, default=base.frame_ms, help="scripted engine frame time")
    p.add_argument(
        "--api-key",
        default=base.api_key,
        help="require 'Authorization: Bearer KEY' (prefer MOSS_RT_API_KEY: flags show in the process list)",
    )
    p.add_argument(
        "--allowed-origins",
        default=",".join(base.allowed_origins),
        help="extra browser origins that may open the WebSocket (comma-separated; * for any)",
    )
    # Reliability and security knobs (docs/limits.md, docs/security.md). Prefer MOSS_RT_API_KEY
    # over --api-key: a flag is visible to every user of the machine in the process list.
    p.add_argument("--cors-origins", default=",".join(base.cors_origins), help="origins that get CORS headers")
    p.add_argument(
        "--token-ttl-sec", type=float, default=base.token_ttl_sec, help="lifetime of browser tokens (POST /api/token)"
    )
    p.add_argument(
        "--max-connections", type=int, default=base.max_connections, help="WebSocket connections open at once"
    )
    p.add_argument("--max-takes-per-client", type=int, default=base.max_takes_per_client, help="0: no cap")
    p.add_argument("--http-requests-per-sec", type=float, default=base.http_requests_per_sec, help="0: no limit")
    p.add_argument(
        "--http-request-burst", type=int, default=base.http_request_burst, help="burst allowed above that rate"
    )
    p.add_argument(
        "--trusted-proxies",
        default=",".join(base.trusted_proxies),
        help="reverse proxies (IPs or CIDRs, comma-separated) whose X-Forwarded-For names the client",
    )
    p.add_argument(
        "--ws-idle-timeout-sec",
        type=float,
        default=base.ws_idle_timeout_sec,
        help="close a WebSocket with no message and no take for this long",
    )
    p.add_argument(
        "--ws-heartbeat-sec", type=float, default=base.ws_heartbeat_sec, help="server ping interval (0: none)"
    )
    p.add_argument(
        "--send-stall-timeout-sec",
        type=float,
        default=base.send_stall_timeout_sec,
        help="drop a client that leaves one send unread this long",
    )
    p.add_argument(
        "--shutdown-grace-sec",
        type=float,
        default=base.shutdown_grace_sec,
        help="time running takes get to send their end on SIGTERM",
    )
    p.add_argument("--log-level", default=base.log_level, help="DEBUG | INFO | WARNING | ERROR")
    p.set_defaults(func=run_serve, base=base)


def run_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from moss_rt.web import create_app

    settings: Settings = args.base.replace(
        host=args.host,
        port=args.port,
        engine=args.engine,
        model=args.model,
        codec=args.codec,
        device=args.device,
        dtype=args.dtype,
        data_dir=args.data_dir,
        voices_dir=args.voices_dir,
        max_slots=args.max_slots,
        max_queue=args.max_queue,
        max_lead_sec=args.max_lead_sec,
        max_seq_len=args.max_seq_len,
        frame_ms=args.frame_ms,
        heard_audio_mb=args.heard_audio_mb,
        api_key=args.api_key or None,
        allowed_origins=tuple(o for o in args.allowed_origins.split(",") if o),
        cors_origins=tuple(o for o in args.cors_origins.split(",") if o),
        token_ttl_sec=args.token_ttl_sec,
        max_connections=args.max_connections,
        max_takes_per_client=args.max_takes_per_client,
        http_requests_per_sec=args.http_requests_per_sec,
        http_request_burst=args.http_request_burst,
        trusted_proxies=tuple(p.strip() for p in args.trusted_proxies.split(",") if p.strip()),
        ws_idle_timeout_sec=args.ws_idle_timeout_sec,
        ws_heartbeat_sec=args.ws_heartbeat_sec,
        send_stall_timeout_sec=args.send_stall_timeout_sec,
        shutdown_grace_sec=args.shutdown_grace_sec,
        log_level=args.log_level,
    )
    setup_logging(settings.log_level)
    engine = build_engine(settings)
    app = create_app(settings, engine)
    log.info("moss_rt on http://%s:%d (engine %s)", settings.host, settings.port, settings.engine)
    # run_app turns SIGTERM and SIGINT into a graceful exit: stop listening, then the app's
    # on_shutdown ends running takes with reason "shutdown" and closes sockets with 1001.
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        print=None,
        handler_cancellation=True,
        shutdown_timeout=settings.shutdown_grace_sec,
    )
    return 0


# --------------------------------------------------------------------------- say


def add_say(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("say", help="synthesize one take through a running service (or --model locally)")
    p.add_argument("text", help="the line to speak")
    p.add_argument("--instruction", default="", help="direction: how to say it (e.g. 'warm, unhurried')")
    p.add_argument("--language", default="", help="language of the text (e.g. English); empty: the model decides")
    p.add_argument("--reference", default="none", help="voice: a built-in voice id, an uploaded ref_id, or none")
    p.add_argument(
        "--seed", type=int, default=None, help="sampling seed (default: random over ws, 0 over http as the legacy API)"
    )
    p.add_argument("--tokens", type=int, default=None, help="duration hint in 80 ms frames")
    p.add_argument("--temperature", type=float, default=None, help="audio temperature (0 = greedy)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="most 80 ms frames to generate")
    p.add_argument("--channels", type=int, choices=(1, 2), default=1, help="1: mono (default), 2: stereo")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="file to write (default out.wav); .mp3 .opus .aac .flac .pcm write that format, anything else WAV",
    )
    p.add_argument("--url", default="http://127.0.0.1:8770", help="the service (default %(default)s)")
    p.add_argument(
        "--transport",
        choices=("ws", "http"),
        default="ws",
        help="ws: the directing WebSocket (default); http: the legacy POST /api/stream",
    )
    p.add_argument("--model", default=None, help="run a local checkpoint folder instead of a service")
    p.add_argument("--codec", default=None, help="with --model: codec folder for audio output")
    p.add_argument("--codes-out", type=Path, default=None, help="with --model: save codes [T,12] as .npy")
    p.add_argument("--device", default="cpu", help="with --model: cpu | cuda | cuda:N (default %(default)s)")
    p.set_defaults(func=run_say)


def _say_fields(args: argparse.Namespace) -> dict[str, object]:
    fields: dict[str, object] = {
        "instruction": args.instruction,
        "language": args.language,
        "reference": args.reference,
        "channels": args.channels,
    }
    for name, value in (
        ("seed", args.seed),
        ("tokens", args.tokens),
        ("audio_temperature", args.temperature),
        ("max_new_tokens", args.max_new_tokens),
    ):
        if value is not None:
            fields[name] = value
    return fields


def write_audio(path: Path, pcm: bytes, channels: int) -> None:
    """Write 48 kHz int16 PCM as the format the file's extension names (wav when it names none)."""
    from moss_rt.formats import FORMATS, AudioFormat

    name = path.suffix.lower().lstrip(".")
    if name not in FORMATS or name == "wav":
        from moss_rt.audio import wav_bytes

        path.write_bytes(wav_bytes(pcm, 48000, channels))
        return
    from moss_rt.formats.encoder import encode_all

    path.write_bytes(encode_all(pcm, AudioFormat(name), channels))


def run_say(args: argparse.Namespace) -> int:
    setup_logging("WARNING")
    if args.model is not None:
        from moss_rt.model.commands import say_codes_command

        return say_codes_command(args)
    from moss_rt.client import DirectingClient, ServerError, http_stream

    fields = _say_fields(args)

    async def _ws() -> object:
        url = args.url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/api/ws"
        async with DirectingClient.connect(url) as client:
            return await client.speak(args.text, **fields)

    try:
        if args.transport == "ws":
            take = asyncio.run(_ws())
        else:
            fields.pop("channels")
            take = asyncio.run(http_stream(args.url, text=args.text, **fields))
    except (ServerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    output = args.output or Path("out.wav")
    write_audio(output, bytes(take.pcm), take.channels)  # type: ignore[attr-defined]
    end = take.end  # type: ignore[attr-defined]
    print(f"wrote {output}: {take.duration_sec:.2f} s, take {take.take_id}, end {end.get('reason')}")  # type: ignore[attr-defined]
    return 0


# --------------------------------------------------------------------------- make-tiny


def add_make_tiny(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("make-tiny", help="write a tiny random model (and codec) in the real on-disk layout")
    p.add_argument("dir", type=Path, help="folder to write the model (and codec) into")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weight dtype on disk")
    p.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    setup_logging("INFO")
    from moss_rt.model.commands import make_tiny_command

    return make_tiny_command(args)


def build_parser(prog: str = "moss-rt") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_say(sub)
    add_make_tiny(sub)
    return parser


def main(argv: list[str] | None = None, *, prog: str = "moss-rt") -> int:
    args = build_parser(prog).parse_args(argv)
    return int(args.func(args))


__all__ = ["build_engine", "build_parser", "main"]
