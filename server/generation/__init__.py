"""The protocol-neutral request path every front end shares: :mod:`.request` (what is asked and
answered), :mod:`.pipeline` (render and tokenize: ``Generator``), :mod:`.generation` (a request's
choices from submission to their last delta), :mod:`.submission` (prepare, admit and submit the
sequences) and :mod:`.choice` (one choice's text, calls and finish reason). No HTTP or gRPC type
appears here."""
