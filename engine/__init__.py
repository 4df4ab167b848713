"""The engine: one process that owns the model and the KV cache and runs continuous batching
over token ids (docs/architecture.md). Front ends talk to it only through :mod:`engine.client`."""
