"""The protocol-neutral request path every front end shares: :mod:`.request` (what is asked and
answered) and :mod:`.pipeline` (prepare, admit and submit the sequences, then follow and
detokenize them). No HTTP or gRPC type appears here."""
