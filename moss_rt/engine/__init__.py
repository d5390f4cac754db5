"""Engines: the seam (base), the scripted test engine, and the real MOSS engine."""
