"""The lock's model checker: the world it runs in (masters, fault proxy, clients) and
what it checks (see ``tests/core/test_model.py`` for the state machine)."""
