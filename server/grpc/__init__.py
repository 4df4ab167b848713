"""The gRPC front end: the service (:mod:`.service`), the sidecar process that serves it
(:mod:`.server`, ``python -m server.grpc.server``) and the gunicorn master's keeper of that
process (:mod:`.keeper`). The master imports the keeper only, and must never load the ``grpc``
library (its core does not survive ``fork``): this package's ``__init__`` imports nothing."""
