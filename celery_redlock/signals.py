"""Signals celery-redlock sends, for metrics and alerting.

Every signal's sender is the task (or the beat service for beat signals).
Connect receivers like any Celery signal::

    from celery_redlock import signals


    @signals.lock_contended.connect
    def count(sender, key, **kw):
        metrics.incr("lock.contended", tags={"task": sender.name})
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "beat_no_leader",
    "beat_not_sent",
    "beat_status",
    "duplicate_dropped",
    "lock_acquired",
    "lock_contended",
    "lock_lost",
    "lock_released",
    "lock_renewed",
    "lock_unavailable",
    "master_state",
]

#: The lock was taken before the body runs. Arguments: ``key``, ``lease``,
#: ``task_id``, ``waited`` (seconds the acquire took), ``rescheduled_for`` (seconds since
#: celery-redlock first rescheduled this job, for contention, an outage or its own earlier
#: run, since its last ``retry()``; 0.0 when it never did; wall clock, across hosts).
lock_acquired = Signal(name="redlock_lock_acquired")

#: Someone else holds the key. Arguments: ``key``, ``task_id``, ``action``
#: (``"retry"``, ``"skip"``, ``"raise"`` or ``"give_up"``), ``countdown``
#: (seconds until the reschedule, or None), ``attempt`` (contention count).
lock_contended = Signal(name="redlock_lock_contended")

#: The masters were unavailable; the task is rescheduled. Arguments: ``key``,
#: ``task_id``, ``countdown``, ``errors`` (per master).
lock_unavailable = Signal(name="redlock_lock_unavailable")

#: The lock was released after the body. Arguments: ``key``, ``lease``, ``task_id``,
#: ``held_for`` (seconds), ``confirmed`` (a quorum confirmed the deletion; None when
#: the release was sent without waiting, as after a body returns).
lock_released = Signal(name="redlock_lock_released")

#: The heartbeat renewed a held lock. Sender: None (the renewal engine serves every task
#: of the process). Arguments: ``key``, ``lease``, ``took`` (seconds the renewal round
#: took), ``margin`` (seconds of validity the lease had left when the round was sent:
#: renewal lag shows as a shrinking margin; at 0 the lock is lost).
lock_renewed = Signal(name="redlock_lock_renewed")

#: A master stopped answering (``up=False``) or answers again (``up=True``); sent on the
#: transition, as seen by this process. Sender: None. Arguments: ``master`` (its name,
#: without credentials), ``up``, ``error`` (why it is down; ``""`` when up).
master_state = Signal(name="redlock_master_state")

#: The heartbeat could not keep the lock while the body ran. Arguments: ``key``,
#: ``lease``, ``task_id``, ``reason``, ``policy`` (``"log"`` or ``"interrupt"``).
lock_lost = Signal(name="redlock_lock_lost")

#: A duplicate was dropped: an enqueue deduplicated (``stage="publish"``,
#: ``existing_id``) or a beat occurrence delivered twice (``stage="worker"``).
#: Arguments: ``key``, ``task_id``, ``stage``, ``existing_id``.
duplicate_dropped = Signal(name="redlock_duplicate_dropped")

#: Beat leadership changed. Arguments: ``status`` (``"leader"`` or ``"standby"``),
#: ``previous``, ``identity`` (this beat's ``host:pid:random``, as its log lines and
#: :func:`celery_redlock.beat.beat_status` name it).
beat_status = Signal(name="redlock_beat_status")

#: A leading beat did not send an occurrence that fell due (or that it was catching up
#: on): it could not claim it on a quorum, or it lost the leader lease meanwhile. Sent
#: with a warning. Arguments: ``entry`` (its name), ``occurrence`` (None when it could not
#: even be named), ``reason``.
beat_not_sent = Signal(name="redlock_beat_not_sent")

#: No beat can lead: a beat could not reach a quorum of the masters to take (or keep) the
#: leader lease, so no guarded entry is sent. Sent with an ERROR once per lease period
#: while it lasts. Arguments: ``reason``, ``down_for`` (seconds since it began).
beat_no_leader = Signal(name="redlock_beat_no_leader")
