"""``python -m proj.dbsetup NAME=SECONDS ...``: migrate the sqlite DB and add interval tasks.

Each ``NAME=SECONDS`` becomes a django-celery-beat ``PeriodicTask`` named NAME on an
``IntervalSchedule`` of SECONDS, calling ``proj.app.tick(kind=NAME)``; ``NAME=once:EPOCH``
a ``one_off`` task on a ``ClockedSchedule`` at that time.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.django_settings")
    import django

    django.setup()

    from django.core.management import call_command
    from django.db import transaction

    call_command("migrate", verbosity=0)
    # One transaction, as an admin save with ATOMIC_REQUESTS makes it: django-celery-beat
    # marks a PeriodicTask changed in pre_save, before the row is written, and a beat that
    # reloads in between reads the old row and does not reload again (a test once saw the
    # old interval kept for good).
    with transaction.atomic():
        _write(argv)


def _write(argv: list[str]) -> None:
    import datetime as dt

    from django_celery_beat.models import ClockedSchedule, IntervalSchedule, PeriodicTask

    for spec in argv:
        name, _, seconds = spec.partition("=")
        if seconds.startswith("once:"):
            at = dt.datetime.fromtimestamp(float(seconds[5:]), dt.timezone.utc)
            clocked = ClockedSchedule.objects.create(clocked_time=at)
            PeriodicTask.objects.update_or_create(
                name=name,
                defaults={
                    "task": "proj.app.tick",
                    "clocked": clocked,
                    "one_off": True,
                    "kwargs": json.dumps({"kind": name}),
                },
            )
            continue
        every, _ = IntervalSchedule.objects.get_or_create(
            every=int(seconds), period=IntervalSchedule.SECONDS
        )
        PeriodicTask.objects.update_or_create(
            name=name,
            defaults={
                "task": "proj.app.tick",
                "interval": every,
                "kwargs": json.dumps({"kind": name}),
            },
        )


if __name__ == "__main__":
    main(sys.argv[1:])
