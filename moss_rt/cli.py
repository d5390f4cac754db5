"""Command line: ``python -m moss_rt serve | say | make-tiny``."""

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
    """The engine named by settings (imported lazily: the scripted one needs no torch, and only
    cluster mode imports Ray)."""
    if settings.cluster:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise SystemExit("--cluster needs Ray: pip install -r requirements-cluster.txt (docs/cluster.md)")
        from moss_rt.cluster.router import ClusterEngine

        return ClusterEngine(settings)
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
    p.add_argument("--host", default=base.host)
    p.add_argument("--port", type=int, default=base.port)
    p.add_argument("--engine", choices=("moss", "scripted"), default=base.engine)
    p.add_argument("--model", default=base.model, help="auto | tiny | PATH | HUB_ID")
    p.add_argument("--codec", default=base.codec, help="auto | tiny | PATH | HUB_ID")
    p.add_argument("--device", default=base.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=base.dtype, help="auto | float32 | bfloat16")
    p.add_argument("--data-dir", type=Path, default=base.data_dir, help="uploaded voices, tiny models")
    p.add_argument("--voices-dir", type=Path, default=base.voices_dir, help="built-in voices (audio files)")
    p.add_argument("--max-slots", type=int, default=base.max_slots)
    p.add_argument("--max-queue", type=int, default=base.max_queue)
    p.add_argument("--max-lead-sec", type=float, default=base.max_lead_sec)
    p.add_argument("--max-seq-len", type=int, default=base.max_seq_len, help="cache positions per slot")
    p.add_argument("--heard-audio-mb", type=int, default=base.heard_audio_mb, help="streamed PCM kept for replays")
    p.add_argument("--frame-ms", type=float, default=base.frame_ms, help="scripted engine frame time")
    p.add_argument("--api-key", default=base.api_key)
    p.add_argument("--allowed-origins", default=",".join(base.allowed_origins))
    # Reliability and security knobs (docs/limits.md, docs/security.md). Prefer MOSS_RT_API_KEY
    # over --api-key: a flag is visible to every user of the machine in the process list.
    p.add_argument("--cors-origins", default=",".join(base.cors_origins), help="origins that get CORS headers")
    p.add_argument("--token-ttl-sec", type=float, default=base.token_ttl_sec)
    p.add_argument("--max-connections", type=int, default=base.max_connections)
    p.add_argument("--max-takes-per-client", type=int, default=base.max_takes_per_client, help="0: no cap")
    p.add_argument("--http-requests-per-sec", type=float, default=base.http_requests_per_sec, help="0: no limit")
    p.add_argument("--http-request-burst", type=int, default=base.http_request_burst)
    p.add_argument(
        "--trusted-proxies",
        default=",".join(base.trusted_proxies),
        help="reverse proxies (IPs or CIDRs, comma-separated) whose X-Forwarded-For names the client",
    )
    p.add_argument("--ws-idle-timeout-sec", type=float, default=base.ws_idle_timeout_sec)
    p.add_argument("--ws-heartbeat-sec", type=float, default=base.ws_heartbeat_sec)
    p.add_argument("--send-stall-timeout-sec", type=float, default=base.send_stall_timeout_sec)
    p.add_argument("--shutdown-grace-sec", type=float, default=base.shutdown_grace_sec)
    p.add_argument("--log-level", default=base.log_level)
    p.add_argument(
        "--cluster",
        default=base.cluster,
        help="run the engine as replicas on Ray: 'auto' (join the local cluster or start one) or a Ray address "
        "(HOST:PORT); empty (default): in this process (docs/cluster.md)",
    )
    p.add_argument("--replicas", type=int, default=base.replicas, help="with --cluster: 0 = one per GPU")
    p.add_argument("--replica-cpus", type=float, default=base.replica_cpus, help="with --cluster: CPUs per replica")
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
        cluster=args.cluster,
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
    )
    setup_logging(settings.log_level)
    engine = build_engine(settings)
    app = create_app(settings, engine)
    log.info("moss_rt on http://%s:%d (engine %s%s)", settings.host, settings.port, settings.engine,
             f", cluster {settings.cluster}" if settings.cluster else "")
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
    p.add_argument("text")
    p.add_argument("--instruction", default="")
    p.add_argument("--language", default="")
    p.add_argument("--reference", default="none")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None, help="duration hint in 80 ms frames")
    p.add_argument("--temperature", type=float, default=None, help="audio temperature (0 = greedy)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--channels", type=int, choices=(1, 2), default=1)
    p.add_argument("-o", "--output", type=Path, default=None, help="WAV file to write")
    p.add_argument("--url", default="http://127.0.0.1:8770")
    p.add_argument("--transport", choices=("ws", "http"), default="ws")
    p.add_argument("--model", default=None, help="run a local checkpoint folder instead of a service")
    p.add_argument("--codec", default=None, help="with --model: codec folder for audio output")
    p.add_argument("--codes-out", type=Path, default=None, help="with --model: save codes [T,12] as .npy")
    p.add_argument("--device", default="cpu")
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
    take.write_wav(output)  # type: ignore[attr-defined]
    end = take.end  # type: ignore[attr-defined]
    print(f"wrote {output}: {take.duration_sec:.2f} s, take {take.take_id}, end {end.get('reason')}")  # type: ignore[attr-defined]
    return 0


# --------------------------------------------------------------------------- make-tiny


def add_make_tiny(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("make-tiny", help="write a tiny random model (and codec) in the real on-disk layout")
    p.add_argument("dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weight dtype on disk")
    p.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    setup_logging("INFO")
    from moss_rt.model.commands import make_tiny_command

    return make_tiny_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moss_rt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_say(sub)
    add_make_tiny(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


__all__ = ["build_engine", "main"]
