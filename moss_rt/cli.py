"""Command line: ``moss-rt serve | say | render | make-tiny`` (also ``python -m moss_rt ...``)."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from moss_rt.config import add_setting_flags, settings_from_env, settings_from_flags
from moss_rt.logging_setup import setup_logging
from moss_rt.serving import build_engine

log = logging.getLogger("moss_rt")
# Connection errors that mean "nothing answers there": refused, host or network unreachable, timed out.
_UNREACHABLE = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EADDRNOTAVAIL}


# --------------------------------------------------------------------------- serve


def add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the service (env MOSS_RT_<FLAG> sets defaults)")
    base = settings_from_env()
    # One flag per Settings field (docs/limits.md, docs/security.md for the reliability knobs).
    add_setting_flags(p, base)
    p.set_defaults(func=run_serve, base=base)


def run_serve(args: argparse.Namespace) -> int:
    settings = settings_from_flags(args, args.base)
    setup_logging(settings.log_level)
    engine = build_engine(settings)
    # The model starts loading now, on the engine's thread, while the web app below is imported and built and the
    # session store opens (start-up, issue 24); an engine without this starts when the app does.
    begin_loading = getattr(engine, "begin_loading", None)
    if begin_loading is not None:
        begin_loading()
    from aiohttp import web

    from moss_rt.storage.database import StoreConfigError, StoreUnavailable
    from moss_rt.web.app import create_app
    from moss_rt.web.state import STATE

    try:
        app = create_app(settings, engine, exit_on_engine_failure=True)
    except ValueError as exc:  # a malformed setting (an alias map, ...): say which, no traceback
        print(f"moss_rt: {exc}", file=sys.stderr)
        return 2
    except StoreConfigError as exc:  # --session-store cannot be used (scheme, driver): say why
        print(f"moss_rt: the session store cannot be opened: {exc}", file=sys.stderr)
        return 2
    log.info("moss_rt on http://%s:%d (engine %s%s)", settings.host, settings.port, settings.engine,
             f", cluster {settings.cluster}" if settings.cluster else "")
    # run_app turns SIGTERM and SIGINT into a graceful exit: stop listening, then the app's
    # on_shutdown ends running takes with reason "shutdown" and closes sockets with 1001.
    try:
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            print=None,
            handler_cancellation=True,
            shutdown_timeout=settings.shutdown_grace_sec,
            reuse_port=settings.reuse_port or None,
        )
    except (StoreConfigError, StoreUnavailable) as exc:  # the store could not be opened at start: say why
        print(f"moss_rt: the session store cannot be opened: {exc}", file=sys.stderr)
        return 1
    failure = app[STATE].engine_failure
    if failure is not None:
        print(f"moss_rt: the engine failed to start: {failure}", file=sys.stderr)
        return 1
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
        help="file to write (default out.wav); its extension picks the format: .wav, .mp3, .opus or .ogg (Opus in "
        "Ogg), .aac (ADTS), .flac, .pcm or .raw (int16, no header); none: WAV; any other is refused",
    )
    p.add_argument("--words", type=Path, default=None, help="write the take's word timings here (JSON)")
    p.add_argument("--srt", type=Path, default=None, help="write the take's captions here (SubRip)")
    p.add_argument("--vtt", type=Path, default=None, help="write the take's captions here (WebVTT)")
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


def _say_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {
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


# The file extensions `say -o` writes, and the delivery format each means. .ogg is Opus in Ogg, which is what the
# opus format is; an .m4a (AAC in MP4) needs a seekable muxer this encoder does not use: refused, as is any other.
OUTPUT_FORMATS = {
    "": "wav", "wav": "wav", "mp3": "mp3", "opus": "opus", "ogg": "opus", "oga": "opus", "aac": "aac", "flac": "flac",
    "pcm": "pcm", "raw": "pcm",
}  # fmt: skip


def output_format(path: Path) -> str:
    """The format ``say`` writes ``path`` in, from its extension; ValueError for one it cannot write."""
    ext = path.suffix.lower().lstrip(".")
    if ext not in OUTPUT_FORMATS:
        known = ", ".join(f".{e}" for e in OUTPUT_FORMATS if e)
        raise ValueError(f"cannot write {path.suffix!r} files; use one of {known} (no extension: WAV)")
    return OUTPUT_FORMATS[ext]


def write_audio(path: Path, pcm: bytes, channels: int) -> None:
    """Write 48 kHz int16 PCM in the format the file's extension names (:func:`output_format`)."""
    from moss_rt.formats import AudioFormat

    name = output_format(path)
    if name == "wav":
        from moss_rt.audio import wav_bytes

        path.write_bytes(wav_bytes(pcm, 48000, channels))
        return
    from moss_rt.formats.encoder import encode_all

    path.write_bytes(encode_all(pcm, AudioFormat(name), channels))


def unreachable_hint(url: str, exc: BaseException) -> str:
    """What to do when no service answers at ``url``."""
    return (
        f"no moss_rt service answers at {url} ({exc}). Start one with `moss-rt serve` (or `make run`), point "
        "--url at a running service, or run a checkpoint locally with --model PATH"
    )


def run_say(args: argparse.Namespace) -> int:
    setup_logging("WARNING")
    if args.model is not None:
        return _say_locally(args)
    from websockets.exceptions import InvalidHandshake, InvalidURI

    from moss_rt.client import DirectingClient, ServerError, fetch_words, http_stream

    output = args.output or Path("out.wav")
    try:
        output_format(output)  # refused before anything is generated
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fields = _say_fields(args)
    want_words = args.words is not None or args.srt is not None or args.vtt is not None
    if want_words and args.transport == "ws":
        fields["words"] = True  # streamed with the take (the HTTP transport fetches them afterwards)

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
    except ConnectionError as exc:  # refused, reset: nothing listens there (aiohttp's connector errors too)
        print(f"error: {unreachable_hint(args.url, exc)}", file=sys.stderr)
        return 1
    except OSError as exc:
        if isinstance(exc, socket.gaierror) or getattr(exc, "errno", None) in _UNREACHABLE:
            print(f"error: {unreachable_hint(args.url, exc)}", file=sys.stderr)
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 1
    except (InvalidHandshake, InvalidURI) as exc:  # not a moss_rt WebSocket there (or it refused the upgrade)
        print(f"error: the service at {args.url} did not accept the WebSocket: {exc}", file=sys.stderr)
        return 1
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_audio(output, bytes(take.pcm), take.channels)  # type: ignore[attr-defined]
    try:
        _write_words(args, take, fetch_words)
    except (ServerError, OSError) as exc:
        print(f"error: the take's words: {exc}", file=sys.stderr)
        return 1
    end = take.end  # type: ignore[attr-defined]
    print(f"wrote {output}: {take.duration_sec:.2f} s, take {take.take_id}, end {end.get('reason')}")  # type: ignore[attr-defined]
    return 0


def _say_locally(args: argparse.Namespace) -> int:
    """``say --model``: the checkpoint in this process, no service (the tiny one lives in the data dir)."""
    from moss_rt.engine.resolve import tiny_root
    from moss_rt.model.commands import SayCodes, say_codes_command

    request = SayCodes(
        model=args.model, text=args.text, instruction=args.instruction, language=args.language,
        reference=args.reference, seed=args.seed, tokens=args.tokens, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, codes_out=args.codes_out, device=args.device, codec=args.codec,
        output=args.output, channels=args.channels, tiny_dir=tiny_root(settings_from_env()) / "model",
    )  # fmt: skip
    return say_codes_command(request)


def _write_words(args: argparse.Namespace, take: Any, fetch: Any) -> None:
    """``--words``/``--srt``/``--vtt``: the take's word timings as JSON, and its captions from the server."""
    import json

    if args.words is not None:
        words = take.words if take.words or args.transport == "ws" else asyncio.run(fetch(args.url, take.take_id))
        args.words.write_text(json.dumps({"take": take.take_id, "words": words}, indent=1) + "\n", encoding="utf-8")
    for path, fmt in ((args.srt, "srt"), (args.vtt, "vtt")):
        if path is not None:
            path.write_text(asyncio.run(fetch(args.url, take.take_id, fmt)), encoding="utf-8")


# --------------------------------------------------------------------------- render


def add_render(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "render",
        help="render a whole script (docs/scripts.md) through a running service (or --local) into a folder",
        description="Post a script (plain text, or .json), follow its render with a progress bar, and unpack its "
        "export: every line, the mix, cue sheets and captions.",
    )
    p.add_argument("script", type=Path, nargs="?", help="the script: plain text, or the JSON form (.json)")
    p.add_argument("-o", "--output", type=Path, default=Path("out"), help="folder to write (default %(default)s)")
    p.add_argument("--format", default=None, help="audio format of the files: wav (default), flac, mp3, opus, aac, pcm")
    p.add_argument("--sample-rate", type=int, default=None, help="48000 (default), 24000 or 16000")
    p.add_argument("--cast", type=Path, default=None, help="a JSON file {NAME: {voice, instruction, language}} "
                   "laid over the script's own cast")
    p.add_argument("--session", default=None, help="render into this directing session (default: a new one)")
    p.add_argument("--script-id", default=None, help="follow a render already posted (sc_…) instead of posting one")
    p.add_argument("--url", default="http://127.0.0.1:8770", help="the service (default %(default)s)")
    p.add_argument("--local", action="store_true", help="run the service in this process instead (the engine the "
                   "settings name: MOSS_RT_* and the flags below)")
    p.add_argument("--engine", default=None, help="with --local: moss or scripted")
    p.add_argument("--model", default=None, help="with --local: auto | tiny | PATH | HUB_ID")
    p.add_argument("--codec", default=None, help="with --local: auto | tiny | PATH | HUB_ID")
    p.add_argument("--device", default=None, help="with --local: auto | cpu | cuda | cuda:N")
    p.add_argument("--data-dir", type=Path, default=None, help="with --local: data folder (sessions, voices)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--owner-file", type=Path, default=None, help="where the owner cookies of keyless servers are "
                   "kept, so that a later run (--script-id, --session) acts as the same owner (default "
                   "$XDG_STATE_HOME/moss_rt/owners.json, i.e. ~/.local/state/moss_rt/owners.json)")
    p.set_defaults(func=run_render)


def run_render(args: argparse.Namespace) -> int:
    import json

    from moss_rt.scripts.client import OwnerFile, RenderError, default_owner_file, render_script, serve_in_process

    setup_logging("WARNING")
    if args.script is None and args.script_id is None:
        print("error: give a script file (or --script-id to follow one already posted)", file=sys.stderr)
        return 1
    cast = None
    if args.cast is not None:
        try:
            cast = json.loads(args.cast.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            print(f"error: --cast {args.cast}: {exc}", file=sys.stderr)
            return 1

    owners = OwnerFile(args.owner_file or default_owner_file())

    async def _render() -> object:
        url, runner, owners_key = args.url, None, None
        base = settings_from_env()  # MOSS_RT_API_KEY authenticates to the service; with --local, the settings
        if args.local:
            overrides = {k: getattr(args, k) for k in ("engine", "model", "codec", "device", "data_dir")}
            settings = base.replace(**{k: v for k, v in overrides.items() if v is not None})
            url, runner = await serve_in_process(settings)
            # A new port every run: the owner is the data dir's (its secret signs the cookie).
            owners_key = f"local:{settings.data_dir.resolve()}"
        try:
            return await render_script(
                url, args.output, script_path=args.script, script_id=args.script_id, cast=cast,
                session=args.session, fmt=args.format, sample_rate=args.sample_rate,
                api_key=base.api_key, progress=not args.no_progress, owners=owners,
                owners_key=owners_key,
            )  # fmt: skip
        finally:
            if runner is not None:
                await runner.cleanup()

    try:
        result = asyncio.run(_render())
    except (RenderError, OSError, ValueError) as exc:
        hint = "" if args.local else f" (is the service running at {args.url}? start one, or use --local)"
        print(f"error: {exc}{hint if isinstance(exc, OSError) else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the render goes on in the service; follow it with --script-id", file=sys.stderr)
        return 130
    r: Any = result
    print(f"wrote {args.output}/: {r.lines_done} lines, {r.audio_sec:.1f} s of audio ({len(r.files)} files), "
          f"script {r.script_id}, session {r.session_id}")
    for line in r.failed:
        print(f"line {line['line']} ({line['who']}) failed: {line['error']}", file=sys.stderr)
    return 2 if r.failed else 0


# --------------------------------------------------------------------------- make-tiny


def add_make_tiny(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("make-tiny", help="write a tiny random model (and codec) in the real on-disk layout")
    p.add_argument("dir", type=Path, help="folder to write the model (and codec) into")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weight dtype on disk")
    p.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    setup_logging("INFO")
    from moss_rt.model.commands import MakeTiny, make_tiny_command

    return make_tiny_command(MakeTiny(dir=args.dir, seed=args.seed, dtype=args.dtype))


def build_parser(prog: str = "moss-rt") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_say(sub)
    add_render(sub)
    add_make_tiny(sub)
    return parser


def main(argv: list[str] | None = None, *, prog: str = "moss-rt") -> int:
    args = build_parser(prog).parse_args(argv)
    return int(args.func(args))


__all__ = ["build_parser", "main"]
