"""The admission plugin: priority classes, and the gateway's own fair queues in front of a saturated backend.

Owns the plugin (controller.py: `Admission`, a request's class, the gate, shedding), its config (config.py), the
per-backend gate and its queues by class and tenant (queue.py), and the class sent upstream (propagation.py).
It may import the core; never another plugin.
"""

from plugins.admission.controller import Admission

__all__ = ["Admission"]
