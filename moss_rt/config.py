"""Service settings: one frozen record, filled from defaults, ``MOSS_RT_*`` variables and flags.

Every default of the service lives here (or in :class:`moss_rt.protocol.Limits`), so no other
module hides one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moss_rt.protocol import Limits

ENV_PREFIX = "MOSS_RT_"
DEFAULT_PORT = 8770
REAL_MODEL_ID = "laion/moss-tts-local-transformer-4.55b-voice-acting-v2"
REAL_CODEC_ID = "OpenMOSS-Team/MOSS-Audio-Tokenizer-v2"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # "moss" is the real engine (model + codec); "scripted" is the deterministic test engine.
    engine: str = "moss"
    model: str = "auto"  # auto | tiny | PATH | HUB_ID
    codec: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16
    data_dir: Path = Path("data")
    voices_dir: Path = Path("voices")  # built-in voices: audio files in this folder
    static_dir: Path = Path(__file__).resolve().parent.parent / "static"
    # Engine scheduling.
    max_slots: int = 64  # takes generating at once
    max_queue: int = 64  # takes waiting for a slot; beyond this requests are refused as busy
    max_lead_sec: float = 20.0  # audio a client may hold unplayed before its take is paused
    frame_ms: float = 80.0  # scripted engine only: wall time per generated frame
    max_seq_len: int = 5120  # cache positions per slot: prompt rows + frames (longer takes end max_frames)
    prefill_chunk: int = 512  # prompt rows per prefill call (longer prompts are prefilled in pieces)
    prefill_budget_ms: float = 40.0  # prefill work per scheduling round while other takes stream
    # Padded prompt rows per batched prefill pass (all takes' chunks in it x the longest); with the
    # scheduler's keys-per-row bound on rows x longest key window, it bounds the pass's memory and stall.
    prefill_max_rows: int = 8192
    # Streamed PCM kept so replays and downloads send exactly what was heard (else codes are rendered).
    heard_audio_mb: int = 256
    # Connections.
    max_connections: int = 256
    # Concurrent takes (WebSocket and HTTP) per remote address, across its connections; 0: no cap.
    # Behind a reverse proxy every client shares the proxy's address unless it is in trusted_proxies.
    max_takes_per_client: int = 16
    # Requests that cost work (POSTs, WebSocket upgrades, take downloads) per client address: a token
    # bucket refilled at this rate with this burst; 0 disables it.
    http_requests_per_sec: float = 20.0
    http_request_burst: int = 100
    # Reverse proxies (addresses or CIDR ranges) whose X-Forwarded-For names the client.
    trusted_proxies: tuple[str, ...] = ()
    ws_idle_timeout_sec: float = 300.0  # no client message and no take running for this long → close
    ws_heartbeat_sec: float = 20.0  # server pings; no pong within half of it → the socket is dropped
    send_stall_timeout_sec: float = 15.0  # one send blocked this long (client not reading) → disconnect
    shutdown_grace_sec: float = 5.0
    # Security (all optional).
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # empty: same origin only
    cors_origins: tuple[str, ...] = ()
    token_ttl_sec: float = 600.0  # lifetime of browser tokens from POST /api/token
    limits: Limits = field(default_factory=Limits)
    log_level: str = "INFO"
    # Cluster mode (docs/cluster.md): "" runs the engine in this process; "auto" or a Ray address
    # runs it as replicas on a Ray cluster, this process being one of its front ends.
    cluster: str = ""
    replicas: int = 0  # engine replicas; 0: one per GPU in the cluster (one without GPUs)
    replica_cpus: float = 1.0  # CPUs Ray reserves for each replica

    @property
    def voices_store_dir(self) -> Path:
        """Where uploaded voices persist (survives restarts)."""
        return self.data_dir / "voices"

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _convert(kind: Any, raw: str) -> Any:
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
