"""Shared state: the lean RESP client, Redis Cluster routing, and the store with its circuit breaker.

The bottom of the house: it imports nothing from the gateway, so every room can use it. What each stage does
when the store is slow, down or restarted empty is that stage's decision (docs/architecture.md, "Shared state");
this room only reports it faithfully: a call either answers or raises `StoreUnavailable`.

Imports: none.
"""
