"""The cascade plugin: the small model first, the larger one when the small answer fails its checks.

Owns the plugin (escalator.py: `Cascade`, the small call, the escalation within its bound or to a background
job), its config (config.py) and the checks an answer must pass (checks.py). It may import the core; never
another plugin.
"""

from plugins.cascade.escalator import Cascade

__all__ = ["Cascade"]
