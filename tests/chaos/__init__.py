"""Fault-injection suite: histories of lock clients, faults and a fenced resource, checked.

See ``tests/chaos/README.md``.
"""
