"""Benchmarks of celery-redlock against the lock libraries users would pick instead.

Run ``python -m benchmarks lock|renewal|all`` from the repository root (see
``benchmarks/README.md``). Every run starts its own ``redis-server`` masters
(:mod:`celery_redlock.testing`) and never touches a Redis already running on the machine.
"""
