"""moss_rt: a WebSocket-first realtime audio service and directing studio for MOSS-TTS-Local."""

__version__ = "0.1.0"
