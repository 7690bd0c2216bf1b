"""A Celery project run by the beat tests and ``benchmarks/bench_beat.py`` in subprocesses.

``proj.app`` is the Celery app (``celery -A proj.app beat|worker``, with ``tests/beat`` on
``PYTHONPATH``); ``proj.cluster`` starts and watches those processes; ``proj.dbsetup``
prepares the django-celery-beat database.
"""
