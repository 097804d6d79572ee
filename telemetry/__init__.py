"""Where each request's time went: Server-Timing stages, OpenTelemetry traces, Prometheus metrics."""
