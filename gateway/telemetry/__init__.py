"""Where the time went: stage timings, Server-Timing, Prometheus metrics, traces and their export, logs.

Owns everything built from a request after it has ended (metrics, spans), the OTLP encoder and its queue, W3C
trace context, the metric files shared by worker processes, the log formats and the access log's lines. The rest
of the gateway feeds it through the Exchange and the Outcome, never the other way round.

Imports: contract.
"""
