"""The HTTP front end (Falcon, under gunicorn's workers): the app and its routes
(:mod:`.app`), middleware, body reading, JSON and SSE encoding, the OpenAI and ``/infer``
resources, probes, models, the OpenAPI document, and the gunicorn worker class
(:mod:`.worker`, which the master loads: this package's ``__init__`` imports nothing)."""
