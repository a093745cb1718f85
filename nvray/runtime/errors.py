"""Errors the runtime raises to callers."""


class EngineDeadError(RuntimeError):
    """The engine lost a rank or its driver; in-flight and new requests fail with this."""
