"""What the server tells about itself: each request's metrics and log line (:mod:`.telemetry`),
the Prometheus metrics and their scrape (:mod:`.metrics`), and prometheus-client's
multiprocess directory (:mod:`.metrics_dir`)."""
