"""Service settings: one frozen record, filled from defaults, ``MOSS_RT_*`` variables and flags.

Every default of the service lives here (or in :class:`moss_rt.protocol.Limits`), so no other
module hides one. A setting is added in one place, a field of :class:`Settings`: its environment
variable (``MOSS_RT_<FIELD>``) and its ``serve`` flag (``--field-name``) are derived from the field
(:func:`add_setting_flags`); ``help``/``choices`` may be given with :func:`setting`. The fields of
:class:`Limits` get ``MOSS_RT_LIMIT_<FIELD>`` and ``--limit-field-name`` the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moss_rt.openai_aliases import DEFAULT_MODEL_ALIASES, DEFAULT_VOICE_ALIASES
from moss_rt.protocol import Limits
from moss_rt.protocol.limits import LIMIT_HELP

ENV_PREFIX = "MOSS_RT_"
DEFAULT_PORT = 8770
REAL_MODEL_ID = "laion/moss-tts-local-transformer-4.55b-voice-acting-v2"
REAL_CODEC_ID = "OpenMOSS-Team/MOSS-Audio-Tokenizer-v2"


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None) -> Any:  # noqa: A002
    """A settings field with the help text (and choices) of its ``serve`` flag."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices) if choices else None})


@dataclass(frozen=True)
class Settings:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(DEFAULT_PORT, "port to listen on")
    # "moss" is the real engine (model + codec); "scripted" is the deterministic test engine.
    engine: str = setting("moss", "moss: the real model; scripted: the test engine", choices=("moss", "scripted"))
    model: str = setting("auto", "auto | tiny | PATH | HUB_ID")
    codec: str = setting("auto", "auto | tiny | PATH | HUB_ID")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting("auto", "auto | float32 | bfloat16")
    data_dir: Path = setting(Path("data"), "uploaded voices, directing sessions, tiny models")
    # Directing sessions kept in data_dir/sessions (resume on the WebSocket, /api/sessions); off: takes live only
    # as long as their connection (a bounded history of limits.max_takes_kept).
    sessions: bool = setting(True, "keep directing sessions on disk (resume)")
    # Stored sessions are bounded on disk: a session nobody used for this long is deleted by a background sweep,
    # and takes or imports that would take the sessions past these budgets are refused with 507.
    session_retention_days: float = setting(30.0, "delete sessions unused for this many days (0: keep until deleted)")
    session_storage_mb: int = setting(20480, "MB all stored sessions may take in the data dir; past it: 507")
    session_storage_per_client_mb: int = setting(
        4096, "MB the sessions one client address created may take; past it: 507 (0: no cap)"
    )
    # Where the sessions' records live (docs/cluster.md "One session store"): empty is SQLite in
    # data_dir/sessions (one machine, nothing to run); a postgresql:// URL is a PostgreSQL database several
    # front ends share, their takes' files then in session_files, a directory every front end mounts.
    session_store: str = setting(
        "",
        "where directing sessions' records live: empty: SQLite in the data dir; postgresql://USER@HOST/DB: "
        "PostgreSQL shared by several front ends (with --session-files on a shared directory)",
    )
    session_files: str = setting(
        "", "directory of the stored takes' codes and audio (empty: DATA_DIR/sessions); shared by the front ends"
    )
    # Session imports unpack and check whole takes on worker threads: at most this many at once (one per client),
    # so they cannot crowd out the threads others' requests need; exports (packed at their reader's pace) may be
    # four times as many. More: 503 busy / 429.
    max_concurrent_archives: int = setting(2, "session imports at once, one per client (exports: 4x as many)")
    voices_dir: Path = setting(Path("voices"), "built-in voices (audio files)")
    # The studio page: moss_rt/static links to the repository's static/ and is a real folder once installed.
    static_dir: Path = (Path(__file__).resolve().parent / "static").resolve()
    # Engine scheduling.
    # Takes generating at once; 0: chosen by the memory plan at start (64 on a CPU).
    max_slots: int = setting(0, "takes generating at once (0: the memory plan; 64 on a CPU)")
    max_queue: int = setting(64, "takes waiting for a slot; beyond this requests are refused as busy")
    max_lead_sec: float = setting(20.0, "audio a client may hold unplayed before its take is paused (0: no pacing)")
    frame_ms: float = setting(80.0, "scripted engine frame time")  # wall time per generated frame
    # Cache positions of the longest take: prompt rows + frames (longer takes end max_frames). It only
    # caps one take (the paged cache reserves nothing for it); 0: chosen by the memory plan (5120).
    max_seq_len: int = setting(0, "longest take in cache positions, prompt + frames (0: the memory plan)")
    # Fraction of the GPU's memory the service may hold (weights included); the memory plan made at
    # start gives what is free under it to the KV cache, codec state, graph pools and a margin.
    gpu_memory_utilization: float = setting(0.90, "fraction of GPU memory the service may hold, weights included")
    # Emulate a smaller GPU: the process may hold at most this many GiB (torch's per-process memory
    # fraction) and the memory plan budgets that instead of the whole device; 0: the whole device.
    gpu_memory_limit_gib: float = setting(0.0, "emulate a smaller GPU: hold at most this many GiB (0: all of it)")
    # How the codec's streaming K/V (the largest per-take state) is stored: bf16 (as computed: exact streaming; fp32
    # on a CPU), fp8 (8-bit values with a scale per token and head: 53% of the memory, a few times bf16's error,
    # docs/codec.md) or auto: bf16 unless --max-slots asks for more takes than bf16 state fits (memory_plan.py).
    codec_state_dtype: str = setting(
        "auto", "codec streaming K/V storage: auto | bf16 | fp8 (auto: fp8 only when --max-slots needs it)",
        choices=("auto", "bf16", "fp8"),
    )
    prefill_chunk: int = setting(512, "prompt rows per prefill call (longer prompts are prefilled in pieces)")
    # A prefill pass while takes stream holds them for its whole length: 50 ms plus a step (15-25 ms under
    # load on an H200) keeps a running stream's frame within its 80 ms of audio.
    prefill_budget_ms: float = setting(50.0, "prefill work per scheduling round while other takes stream")
    # Passes while takes stream hold at most this many padded rows (longer prompts go in as chunks between
    # frames); 0: sized once at warm-up on a GPU to fit prefill_budget_ms, prefill_max_rows on the CPU.
    prefill_stream_rows: int = setting(0, "padded prompt rows per prefill pass while takes stream (0: fit the budget)")
    # Padded prompt rows per batched prefill pass (all takes' chunks in it x the longest); with the
    # scheduler's keys-per-row bound on rows x longest key window, it bounds the pass's memory and stall.
    prefill_max_rows: int = setting(8192, "padded prompt rows per batched prefill pass")
    # A pass through a batched prefill graph (several takes' pieces, captured once per shape) holds at most this many
    # padded rows: more takes per graphed pass, more and larger captures, and a longer hold on running streams (why
    # the default is 1,024: model/prefill_graphs.BATCH_GRAPH_DEFAULT_ROWS). At most 2,048.
    prefill_graph_rows: int = setting(
        0, "padded prompt rows a batched prefill graph holds at most (0: 1,024, or the longest take if shorter)",
    )
    # While takes stream and interactive takes are about, prefill passes are cut to one prefill graph's size; a
    # scheduling round runs up to this many back to back, within the rows of one budget-sized pass in all, unless a
    # director is mid-session (a retake, continuation or barge-in) or the rows are a render's: then one. 1: one a round
    # always, as before (a burst of new lines then waits for a step between every few of them;
    # engine/scheduler.PREFILL_ROUND_PASSES).
    prefill_round_passes: int = setting(
        4, "graph-sized prefill passes a scheduling round may run back to back while takes stream (1 or more)",
    )
    # Prompt blocks stay in the KV pool after their take until the room is needed, so later takes whose
    # prompts open with the same rows (one voice, one direction) share them instead of prefilling them.
    prompt_cache: bool = setting(True, "keep prompt blocks for later takes whose prompts open the same way")
    # Batch work (script renders, TakeSpec.priority BATCH) runs with what interactive takes leave: it is admitted
    # only while no interactive take waits, prepared with what a prefill pass has left, and holds at most this share
    # of the slots and of the KV cache, so directors always find room.
    batch_share: float = setting(0.5, "share of slots and KV cache batch work (script renders) may hold at once")
    # While a director's take is starting, batch work stands aside from the model steps in at most this share of
    # them (plus a short burst): more, a director's first audio during a render is less delayed and the render slower.
    batch_yield_share: float = setting(
        0.5, "share of the model steps a render's lines may stand aside for directors' first frames (0 to 1)",
    )
    # ...and a prefill pass of a render's prompt rows alone holds at most this share of the rows a pass may hold while
    # takes stream: a director arriving during one waits for less; the render prefills in more, smaller passes.
    batch_pass_share: float = setting(
        0.25, "share of a streaming prefill pass's rows a render's lines may fill while directors are about (0 to 1)",
    )
    # Diagnosis: every scheduling round (its parts' times, what it did) as a JSON line in a file (engine/round_trace).
    round_trace: str | None = setting(None, "write every scheduling round as a JSON line to this file (diagnosis)")
    # The codec decodes due chunks on a thread (and CUDA stream) of its own while the next model steps run;
    # off: the same calls run inline on the engine's thread, after each step (same audio, slower under load).
    codec_overlap: bool = setting(True, "decode audio on its own thread and CUDA stream, overlapped with model steps")
    # The engine's thread gives Python's GIL up at every device sync and waits to get it back while the web server's
    # thread (64 sockets' frames) or the codec's holds it: up to Python's switch interval (5 ms) each time. Shorter,
    # the engine's rounds wait less behind the other threads (process-wide: sys.setswitchinterval). 0: Python's own.
    gil_switch_ms: float = setting(
        0.0, "ms a thread may keep Python's GIL while the engine's waits for it (0: Python's default, 5 ms)",
    )
    # On CUDA, the model's steps and prefill passes and directors' first chunks go on the device's highest-priority
    # streams, steady and batch codec calls on a normal one: the GPU starts the urgent work's blocks first
    # (engine/gpu_streams). Off: every stream at the same priority (the same audio either way).
    stream_priorities: bool = setting(
        True, "on CUDA: model work and directors' first chunks on high-priority streams, steady codec calls after",
    )
    # Directors' first chunks go before steady chunks in the codec, but while the steady chunks back up (and so hold
    # the running streams' steps), one that has waited this long goes first: a flow of directors' ramps must not
    # starve the running streams (engine/codec_worker.py).
    codec_bulk_patience_ms: float = setting(
        40.0, "ms a steady chunk's decode waits behind directors' first chunks at most, once the codec is backed up",
    )
    # ...and while it is not: no step is held yet, but every running stream's audio is late by the wait.
    codec_bulk_longest_wait_ms: float = setting(
        60.0, "ms a steady chunk's decode waits behind directors' first chunks at most while the codec keeps up",
    )
    # ...and a decode of a render's lines only (nobody hears them as they come): longer, so a render's chunks do not
    # go before directors' first chunks (issue 26's fairness); still bounded, so its steps are never held for long.
    codec_batch_patience_ms: float = setting(
        250.0, "ms a decode of a render's chunks waits behind directors' first chunks at most before it goes first",
    )
    # Steady chunks and batch work are decoded in calls of at most this many streams, so a director's first chunk
    # (the codec's priority lane) waits for at most one short call; fewer streams a call: shorter waits, less codec
    # throughput (each call has a fixed cost). 31 fills the codec's 32-row graph bucket (~20-30 ms at full size on an
    # H200). docs/architecture.md.
    codec_call_streams: int = setting(
        255,
        "streams per bulk codec call at most (smaller: a first chunk waits less behind a running call, less "
        "throughput)",
    )
    # Before ready the Triton kernels of the graphs compile ahead of their captures on this many threads at once
    # (engine/warm_compile.py): a cold kernel cache made most of a start compiling, one kernel after another.
    # 1: nothing ahead, every kernel compiles in its capture; 0: one thread per CPU core up to 8 on CUDA, 1 on a CPU.
    compile_threads: int = setting(0, "threads compiling kernels ahead of the warm-up's captures (0: auto; 1: none)")
    # Those kernels compile in as many worker processes, one kernel each at a time, and the engine loads them from
    # Triton's cache (engine/compile_workers.py): threads of one process wait for each other's GIL between compile
    # steps (an H200 host: 51.8 s of compiles took 19.7 s on 8 threads). Off: the threads compile them themselves.
    compile_processes: bool = setting(True, "compile the kernels ahead in worker processes (off: on the threads)")
    # Word timing (docs/words.md): the aligner behind ``words``, captions and seek by word.
    aligner: str = setting(
        "auto", "word aligner: auto | pocketsphinx | ctc:<hub id or folder> | none (docs/words.md)"
    )
    # PocketSphinx worker processes (one CPU core each while aligning); a script render aligns every line as it is
    # stored, so with too few the render waits for its words (200 lines of ~4.5 s: ~0.1 s each, 10 s on 2 workers).
    aligner_workers: int = setting(0, "PocketSphinx worker processes (0: half the CPU cores, 2 to 8)")
    # Alignment jobs waiting for the aligner's workers, all takes together; a streaming take skips a step past it.
    aligner_queue: int = setting(256, "word alignment jobs waiting at most (bounds the aligner's queue)")
    # A streaming take's alignment job reads at most this much of its unsettled audio (what a GPU aligner's network
    # computes over); words unsettled for longer are settled by age, as last placed (docs/words.md). The same
    # default as moss_rt.align.track.STREAM_WINDOW_SEC; at least 1 s.
    aligner_window_sec: float = setting(
        5.0, "seconds of unsettled audio a streaming word alignment job reads at most (older words: settled by age)"
    )
    # A GPU (CTC) aligner's device memory beyond its weights (docs/words.md, "Device memory"): its CUDA graphs' pool
    # holds at most this, and no call of its network computes more (their allocator cache: as much again). The
    # engine's memory plan reserves both when the aligner runs on its GPU.
    aligner_graph_mb: int = setting(1536, "MB a GPU word aligner's CUDA graphs may hold (and each of its calls use)")
    # Streamed PCM kept so replays and downloads send exactly what was heard (else codes are rendered).
    heard_audio_mb: int = setting(256, "streamed PCM kept for replays")
    # Takes' codes rendered again for downloads (their streamed PCM gone), held while read: one
    # render per take shared by its readers; past this, downloads that need a render get 503 busy.
    render_buffer_mb: int = setting(256, "MB of rendered take audio held for downloads; past it: 503 busy")
    # Connections.
    max_connections: int = setting(256, "WebSocket connections open at once")
    # HTTP requests in progress (WebSockets included) per client address; more wait for none: 429.
    max_connections_per_client: int = setting(64, "HTTP requests in progress per client address (0: no cap)")
    # A request body must arrive within body_read_timeout_sec in all, with no pause longer than
    # body_stall_timeout_sec between its pieces; else 408 and the connection is closed.
    body_read_timeout_sec: float = setting(120.0, "a request body must arrive within this long (else 408)")
    body_stall_timeout_sec: float = setting(15.0, "longest pause between a request body's pieces (else 408)")
    http_keepalive_sec: float = setting(30.0, "an idle keep-alive connection is closed after this long")
    # Concurrent takes (WebSocket and HTTP) per remote address, across its connections; 0: no cap.
    # Behind a reverse proxy every client shares the proxy's address unless it is in trusted_proxies.
    max_takes_per_client: int = setting(16, "0: no cap")
    # Requests that cost work (POSTs, WebSocket upgrades, take downloads) per client address: a token
    # bucket refilled at this rate with this burst; 0 disables it.
    http_requests_per_sec: float = setting(20.0, "0: no limit")
    http_request_burst: int = setting(100, "burst of such requests allowed above that rate")
    # Reverse proxies (addresses or CIDR ranges) whose X-Forwarded-For names the client.
    trusted_proxies: tuple[str, ...] = setting(
        (), "reverse proxies (IPs or CIDRs, comma-separated) whose X-Forwarded-For names the client"
    )
    ws_idle_timeout_sec: float = setting(300.0, "close a WebSocket with no message and no take for this long")
    ws_heartbeat_sec: float = setting(20.0, "server ping interval; no pong within half of it drops the socket")
    send_stall_timeout_sec: float = setting(15.0, "drop a client that leaves one send unread this long")
    shutdown_grace_sec: float = setting(5.0, "time running takes get to send their end on SIGTERM")
    # Security (all optional). Prefer MOSS_RT_API_KEY over --api-key: a flag is visible to every
    # user of the machine in the process list.
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' (prefer MOSS_RT_API_KEY)")
    allowed_origins: tuple[str, ...] = setting(
        (), "extra browser origins that may open the WebSocket (comma-separated; empty: same origin only)"
    )
    # Host names a keyless server answers (DNS-rebinding guard); localhost names and loopback
    # addresses always, plus these ("*": any). Ignored when api_key is set.
    allowed_hosts: tuple[str, ...] = setting(
        (), "extra Host names a keyless server answers (DNS-rebinding guard; '*': any)"
    )
    cors_origins: tuple[str, ...] = setting((), "origins that get CORS headers")
    token_ttl_sec: float = setting(600.0, "lifetime of browser tokens from POST /api/token")
    # OpenAI's voice and model names on /v1/audio/speech (docs/openai.md): NAME=TARGET pairs, comma-separated;
    # empty turns them off. Every OpenAI voice speaks with "none" until mapped to a voice of this service.
    openai_voice_aliases: tuple[str, ...] = setting(
        DEFAULT_VOICE_ALIASES, "OpenAI voice names on /v1/audio/speech as NAME=VOICE pairs (empty: none accepted)"
    )
    openai_model_aliases: tuple[str, ...] = setting(
        DEFAULT_MODEL_ALIASES, "OpenAI model names as NAME=MODEL pairs ('default': the default model; empty: none)"
    )
    # Script renders (docs/scripts.md): their lines run at batch priority, as many at once as these shares of the
    # engine's slots allow; the rest of the slots (and the engine's queue) stay for interactive takes.
    # The total matches the scheduler's share for batch work, so lines wait here (fairly, per client) rather than
    # in the engine's queue, where they would hold places interactive takes may need.
    script_total_share: float = setting(0.5, "share of the engine's slots all script renders together may fill")
    script_client_share: float = setting(0.375, "share of the engine's slots one client's script renders may fill")
    max_scripts_per_client: int = setting(4, "scripts one client may have waiting or rendering (0: no cap)")
    max_script_exports: int = setting(4, "script zip exports streaming at once; past it: 503 busy (0: no cap)")
    limits: Limits = field(default_factory=Limits)
    log_level: str = setting("INFO", "DEBUG | INFO | WARNING | ERROR")
    # Cluster mode (docs/cluster.md): "" runs the engine in this process; "auto" or a Ray address
    # runs it as replicas on a Ray cluster, this process being one of its front ends.
    cluster: str = setting(
        "",
        "run the engine as replicas on Ray: 'auto' (join the local cluster or start one) or a Ray address "
        "(HOST:PORT); empty: in this process (docs/cluster.md)",
    )
    replicas: int = setting(0, "with --cluster: engine replicas to find or create; 0: one per GPU")
    replica_cpus: float = setting(1.0, "with --cluster: CPUs Ray reserves for each replica")
    # Cache-aware routing (docs/cluster.md): a new take goes to the replica that keeps the longest run of its
    # prompt blocks, unless that replica has more than this many takes (active + queued) above the least
    # loaded one; -1 routes by load alone.
    route_cache_margin: int = setting(
        8, "with --cluster: takes a replica holding a new take's prompt may be above the least loaded one and "
        "still get it (-1: route by load alone)"
    )
    # SO_REUSEPORT: several front-end processes (or servers) listen on one port; the kernel spreads
    # connections over them (docs/cluster.md).
    reuse_port: bool = setting(False, "listen with SO_REUSEPORT, so several processes share the port")

    @property
    def session_files_dir(self) -> Path:
        """Where stored takes' files live (and the SQLite store's database)."""
        return Path(self.session_files) if self.session_files else self.data_dir / "sessions"

    @property
    def voices_store_dir(self) -> Path:
        """Where uploaded voices persist (survives restarts)."""
        return self.data_dir / "voices"

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _convert(kind: Any, raw: str) -> Any:
    if kind in (bool, "bool"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if kind in (int, "int"):
        return int(raw)
    if kind in (float, "float"):
        return float(raw)
    if kind in (Path, "Path"):
        return Path(raw)
    if kind in ("tuple[str, ...]",):
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    return raw


def _field_kind(f: dataclasses.Field[Any]) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("str | None", "str")


def settings_from_env(env: Mapping[str, str] | None = None, base: Settings | None = None) -> Settings:
    """Apply ``MOSS_RT_<FIELD>`` and ``MOSS_RT_LIMIT_<FIELD>`` variables over ``base``."""
    env = os.environ if env is None else env
    base = base or Settings()
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None and f.name != "limits":
            changes[f.name] = _convert(_field_kind(f), raw)
    limit_changes: dict[str, Any] = {}
    for f in dataclasses.fields(Limits):
        raw = env.get(f"{ENV_PREFIX}LIMIT_{f.name.upper()}")
        if raw is not None:
            limit_changes[f.name] = _convert(_field_kind(f), raw)
    if limit_changes:
        changes["limits"] = dataclasses.replace(base.limits, **limit_changes)
    return base.replace(**changes)


# --------------------------------------------------------------------------- command-line flags
# Not derived: ``limits`` (its fields get flags of their own) and ``static_dir`` (the UI ships with
# the package; tests point it elsewhere through Settings).
_NO_FLAG = ("limits", "static_dir")


def _flag_type(kind: str) -> Any:
    if kind == "tuple[str, ...]":
        return lambda raw: tuple(s.strip() for s in raw.split(",") if s.strip())
    if kind == "str | None":
        return lambda raw: raw or None
    return lambda raw: _convert(kind, raw)


def _add_flags(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    base: Any,
    prefix: str,
    skip: Sequence[str] = (),
    helps: Mapping[str, str] | None = None,
) -> None:
    helps = helps or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        default = getattr(base, f.name)
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = prefix.replace("-", "_") + f.name
        help_text = f.metadata.get("help") or helps.get(f.name)
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help_text}
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, type=_flag_type(kind), **kwargs)


def add_setting_flags(parser: argparse.ArgumentParser, base: Settings) -> None:
    """One ``--flag`` per settings field (``--limit-…`` per limit), defaulting to ``base``."""
    _add_flags(parser, Settings, base, "", _NO_FLAG)
    _add_flags(parser, Limits, base.limits, "limit-", helps=LIMIT_HELP)


def settings_from_flags(args: argparse.Namespace, base: Settings) -> Settings:
    """``base`` with every flag of :func:`add_setting_flags` applied."""
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if f.name not in _NO_FLAG}
    limits = {f.name: getattr(args, "limit_" + f.name) for f in dataclasses.fields(Limits)}
    return base.replace(limits=dataclasses.replace(base.limits, **limits), **changes)
