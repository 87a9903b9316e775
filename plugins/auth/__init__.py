"""The auth plugin: who a request is (its tenant) from its key, and `sluice keys` to manage the keys.

Owns the key lookup and its caches (authenticator.py: the plugin, `Auth`) and the key store's command (keys.py).
It may import the core's contract and `gateway.state`; never another plugin.
"""

from plugins.auth.authenticator import Auth

__all__ = ["Auth"]
