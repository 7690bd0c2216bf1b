"""The Celery-free lock core: a Redlock over N Redis masters, leases, fencing, renewal.

Imports redis-py and the standard library only.
"""

from __future__ import annotations

from .heartbeat import Heartbeat, engine
from .lease import Lease
from .redlock import Redlock

__all__ = ["Heartbeat", "Lease", "Redlock", "engine"]
