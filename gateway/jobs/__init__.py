"""Background jobs run by the gateway: the Responses API's `background: true` and chat completions' jobs.

Owns a job's task that streams its request from the model's real targets and stores every event as it arrives
(background.py, recorder.py), the jobs' records, events and leases in Redis or in process (store.py), and the
signed webhooks that say a job ended, retried from the store by any instance (webhooks.py). Who owns a job is
the Responses room's ownership index; these decide nothing about who may see one, and fail closed when their
store is unavailable.

Imports: contract, state, upstream, wire.
"""
