"""The per-job hot path's caches (issue 17) give the answers the uncached code gives.

Each cache is checked against a fresh object that never saw an earlier call: any
sequence of calls, odd types included, must be accepted or refused exactly alike.
"""

from __future__ import annotations

import enum
import gc
import threading
import types
import weakref
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock import client as client_module
from celery_redlock import settings as settings_module
from celery_redlock.client import client_for, redlock_for, reset_clients
from celery_redlock.keys import canonical_bytes
from celery_redlock.lock import scripts
from celery_redlock.lock.redlock import Redlock
from celery_redlock.memory import MemoryRedlock
from celery_redlock.settings import get_settings, reset_settings

URLS = ["redis://127.0.0.1:1/0"]  # never connected: argument checks only


class _Int(int):
    pass


class _Str(str):
    __slots__ = ()


class _Unit(int):
    """A duration with a unit: compares and hashes as its count, converts to seconds
    (found by the hostile review: a cache keyed on value and type took one for another)."""

    unit: float

    def __new__(cls, count: int, unit: float) -> _Unit:
        self = super().__new__(cls, count)
        self.unit = unit
        return self

    def __float__(self) -> float:
        return int(self) * self.unit


class _Color(enum.IntEnum):
    RED = 1


# Few values, so that calls repeat: those a cache could take for one another (True and 1,
# 0.0 and -0.0, 1 and 1.0 and an int subclass) and some refused ones (NaN each time a new
# object, an unhashable list, a str, numbers out of range), and ints that compare as one
# number and convert to another.
_NUMBERS = [
    None, True, 1, 1.0, _Int(1), 0.3, 30, -0.0, 0.0, 86401, float("nan"), "30", [30],
    _Unit(30, 1.0), _Unit(30, 60.0), _Unit(30, float("inf")), _Unit(5, -1.0),
]  # fmt: skip
_numbers = st.sampled_from(_NUMBERS)
_meta = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(st.sampled_from(["task", "pid", scripts.EXTENSION_FIELD]), st.integers(0, 3)),
        st.one_of(st.text(max_size=3), st.integers(0, 3), st.builds(_Str, st.text(max_size=2))),
        max_size=3,
    ),
)
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "ttl": _numbers,
    "blocking_timeout": _numbers,
    "max_hold": _numbers,
    "renew_every": _numbers,
    "meta": _meta,
    "auto_renew": st.sampled_from([False, True, 0, 1]),
    "node_timeout": st.sampled_from([None, 0.25, 0.5, 40.0]),
}
_call = st.fixed_dictionaries(_FIELDS)
_VALID: dict[str, Any] = {
    "ttl": 30,
    "blocking_timeout": 0,
    "max_hold": None,
    "renew_every": None,
    "meta": None,
    "auto_renew": False,
    "node_timeout": None,
}


def _outcome(redlock: Redlock, call: dict[str, Any]) -> tuple[str, object]:
    try:
        checked = redlock._acquire_arguments(
            "report",
            call["ttl"],
            call["blocking_timeout"],
            call["max_hold"],
            call["renew_every"],
            call["meta"],
            None,
            call["auto_renew"],
        )
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    # Types too: a cached answer must not turn 30 into 30.0 or the reverse.
    return "ok", [(type(v).__name__, v) for v in checked[:5]] + [
        sorted((type(k).__name__, k, type(v).__name__, v) for k, v in checked.fields.items())
    ]


@settings(max_examples=600, deadline=None)
@given(
    st.one_of(st.just(_VALID), _call),
    st.lists(st.tuples(st.sampled_from(sorted(_FIELDS)), st.data()), max_size=12),
)
def test_acquire_argument_checks_answer_as_a_fresh_client_does(
    first: dict[str, Any], changes: list[tuple[str, st.DataObject]]
) -> None:
    # Each call is the one before with one argument changed, so that calls repeat with
    # small differences (True for 1, a changed node_timeout) as a cache could confuse.
    cached = Redlock(URLS)
    call = dict(first)
    try:
        for step in range(len(changes) + 1):
            if step:
                name, data = changes[step - 1]
                call[name] = data.draw(_FIELDS[name], label=name)
            if call["node_timeout"] is not None:
                cached.node_timeout = call["node_timeout"]  # a setting changed under it
            fresh = Redlock(URLS, node_timeout=cached.node_timeout)
            try:
                assert _outcome(cached, call) == _outcome(fresh, call), call
            finally:
                fresh.close()
    finally:
        cached.close()


def _claim_outcome(redlock: Redlock, ttl: object, guard_for: object, suffix: str) -> object:
    try:
        name, checked_ttl, checked_guard = redlock._claim_arguments(
            "report",
            suffix,
            ttl,  # type: ignore[arg-type]
            guard_for,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return name, [(type(v).__name__, v) for v in (checked_ttl, checked_guard)]


_claim_calls = st.lists(
    st.tuples(_numbers, _numbers, st.sampled_from(["dedupe:job", "meta", "fence", ""])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(_claim_calls)
def test_claim_argument_checks_answer_as_a_fresh_client_does(
    calls: list[tuple[object, object, str]],
) -> None:
    # Refused suffixes beside valid numbers: a remembered ttl must not skip the name's check.
    cached = Redlock(URLS)
    memory = MemoryRedlock()
    try:
        for ttl, guard_for, suffix in calls:
            fresh = Redlock(URLS)
            try:
                expected = _claim_outcome(fresh, ttl, guard_for, suffix)
            finally:
                fresh.close()
            assert _claim_outcome(cached, ttl, guard_for, suffix) == expected
            assert _claim_outcome(memory, ttl, guard_for, suffix) == expected
    finally:
        cached.close()


def test_a_number_subclass_is_checked_on_every_call() -> None:
    # The hostile review's case: a claim with a 30 s duration, then one of 30 minutes that
    # compares and hashes as the same 30, got the first one's TTL (and an infinite one
    # was let through).
    redlock = Redlock(URLS)
    try:
        assert redlock._claim_arguments("report", "dedupe:job", _Unit(30, 1.0), None)[1] == 30
        assert redlock._claim_arguments("report", "dedupe:job", _Unit(30, 60.0), None)[1] == 1800
        with pytest.raises(ValueError, match="ttl"):
            redlock._claim_arguments("report", "dedupe:job", _Unit(30, float("inf")), None)
        with pytest.raises(ValueError, match="guard_for"):
            redlock._claim_arguments("report", "dedupe:job", 60, _Unit(5, -1.0))
        assert (
            redlock._acquire_arguments("report", _Unit(30, 1.0), 0, None, None, None, None).ttl
            == 30
        )
        assert (
            redlock._acquire_arguments("report", _Unit(30, 60.0), 0, None, None, None, None).ttl
            == 1800
        )
    finally:
        redlock.close()


def test_the_memory_backend_refuses_a_bad_guard_for_as_redlock_does() -> None:
    with pytest.raises(ValueError, match="guard_for"):
        MemoryRedlock().claim("report", "dedupe:job", "id-1", 60, guard_for=-1)


_LOOKALIKES = [(1, True), (0, False), (True, 1), (1, 1.0), (1.0, _Int(1)), (0.0, -0.0)]


@pytest.mark.parametrize("name", ["ttl", "blocking_timeout", "max_hold", "renew_every"])
@pytest.mark.parametrize(("before", "after"), _LOOKALIKES, ids=repr)
def test_equal_numbers_of_other_types_are_checked_again(
    name: str, before: object, after: object
) -> None:
    base = {**_VALID, "ttl": 30 if name != "ttl" else before}
    cached = Redlock(URLS)
    try:
        _outcome(cached, {**base, name: before})
        call = {**base, name: after}
        assert _outcome(cached, call) == _outcome(Redlock(URLS), call)
    finally:
        cached.close()


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(10**40), max_value=10**40))
def test_an_int_keys_as_the_equal_decimal_and_int_subclass_do(value: int) -> None:
    # int has a fast branch; Decimal and int subclasses take the general one.
    expected = canonical_bytes(Decimal(value))
    assert canonical_bytes(value) == expected
    assert canonical_bytes(_Int(value)) == expected


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_a_str_keys_as_an_equal_str_subclass_does(value: str) -> None:
    assert canonical_bytes(value) == canonical_bytes(_Str(value))


def test_an_int_enum_member_keys_as_its_value() -> None:
    assert canonical_bytes(_Color.RED) == canonical_bytes(1) == canonical_bytes(_Int(1))


def _app(**conf: Any) -> Celery:
    app = Celery("proj", set_as_current=False)
    app.conf.update(redlock_redis_urls=URLS, **conf)
    return app


def test_settings_and_clients_follow_the_app_asked_about() -> None:
    one, two = _app(redlock_key_prefix="one"), _app(redlock_key_prefix="two")
    try:
        for _ in range(3):  # alternating: the "last answer" must never serve the other app
            assert get_settings(one).key_prefix == "one"
            assert get_settings(two).key_prefix == "two"
            assert redlock_for(one).key_prefix == "one"
            assert redlock_for(two).key_prefix == "two"
        assert redlock_for(one) is redlock_for(one)
    finally:
        reset_clients()
        reset_settings()


def test_settings_follow_a_reset_and_a_replaced_conf() -> None:
    app = _app(redlock_key_prefix="before")
    try:
        client = redlock_for(app)
        assert get_settings(app).key_prefix == "before"
        app.conf.redlock_key_prefix = "after"
        reset_settings(app)
        assert get_settings(app).key_prefix == "after"
        assert redlock_for(app) is not client
        assert redlock_for(app).key_prefix == "after"
    finally:
        reset_clients()
        reset_settings()


def test_a_caller_holding_replaced_settings_gets_the_client_of_the_new_ones() -> None:
    # SingletonTask looks the settings up once per publish and asks client_for with them:
    # a reset in between must not bring a client of the old settings back, closing the
    # new one under whoever uses it.
    app = _app(redlock_key_prefix="before")
    try:
        old = get_settings(app)
        assert client_for(app, old) is redlock_for(app)
        app.conf.redlock_key_prefix = "after"
        reset_settings(app)
        current = redlock_for(app)
        assert current.key_prefix == "after"
        assert client_for(app, old) is current  # not a new client of the old settings
        assert redlock_for(app) is current
        assert client_for(app, get_settings(app)) is current
    finally:
        reset_clients()
        reset_settings()


def test_settings_follow_a_replaced_conf() -> None:
    app = Celery("proj", set_as_current=False)
    try:
        for prefix in ("first", "second"):
            # config_from_object replaces app.conf: no reset needed (see get_settings).
            app.config_from_object(
                types.SimpleNamespace(
                    CELERY_REDLOCK_REDIS_URLS=URLS, CELERY_REDLOCK_KEY_PREFIX=prefix
                ),
                namespace="CELERY",
            )
            assert get_settings(app).key_prefix == prefix
            assert redlock_for(app).key_prefix == prefix
    finally:
        reset_clients()
        reset_settings()


def test_the_last_answer_keeps_no_app_or_client_alive() -> None:
    app = _app()
    get_settings(app)
    client = weakref.ref(redlock_for(app))
    gone = weakref.ref(app)
    del app
    gc.collect()
    assert gone() is None
    assert client() is None  # nothing but its app's entry held it


# -- found by the hostile review of these caches (each failed before its fix) --------------


class _Conf(dict[str, Any]):
    """A conf that takes weak references, as Celery's Settings does."""


class _App:
    def __init__(self, conf: Any) -> None:
        self.conf = conf


class _Pausing(weakref.WeakKeyDictionary[Any, Any]):
    """A cache whose lookup by the thread named "racer" pauses once: a preemption there.

    Not while ``unless_held`` is held: a lookup made under that lock has nothing that
    could run in between (and pausing would hold up the other thread until the timeout).
    """

    def __init__(self, unless_held: Any = None) -> None:
        super().__init__()
        self.paused, self.resume, self.done = threading.Event(), threading.Event(), False
        self.unless_held = unless_held

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key, default)
        if threading.current_thread().name == "racer" and not self.done:
            self.done = True
            self.paused.set()
            if self.unless_held is None or not self.unless_held.locked():
                self.resume.wait(10)
        return found


def _race(call: Callable[[], object], meanwhile: Callable[[], object], cache: _Pausing) -> None:
    racer = threading.Thread(target=call, name="racer")
    racer.start()
    try:
        assert cache.paused.wait(10)
        meanwhile()
    finally:
        cache.resume.set()
        racer.join(10)
    assert not racer.is_alive()


def test_a_reset_during_a_settings_lookup_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _Pausing()
    monkeypatch.setattr(settings_module, "_cache", cache)
    reset_settings()
    conf = _Conf(redlock_backend="memory", redlock_ttl=30)
    app = _App(conf)
    assert get_settings(app).ttl == 30
    get_settings(_App(_Conf(redlock_backend="memory")))  # the last answer: another app's

    def reconfigure() -> None:
        conf["redlock_ttl"] = 45
        reset_settings()

    _race(lambda: get_settings(app), reconfigure, cache)
    assert [get_settings(app).ttl for _ in range(3)] == [45, 45, 45]


class _PausingConf(_Conf):
    """A conf whose read of ``redlock_ttl`` by the thread named "racer" pauses once: a
    lookup preempted with the old value in hand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused, self.resume, self.done = threading.Event(), threading.Event(), False

    def get(self, key: str, default: Any = None) -> Any:
        found = super().get(key, default)
        if key == "redlock_ttl" and threading.current_thread().name == "racer" and not self.done:
            self.done = True
            self.paused.set()
            self.resume.wait(10)
        return found


def test_a_reset_while_a_lookup_reads_the_conf_is_not_lost() -> None:
    # Found by a hostile review: the lookup stored what it had read into the per-app cache
    # after the reset that stood for a change, and every later lookup kept it.
    reset_settings()
    conf = _PausingConf(redlock_backend="memory", redlock_ttl=30)
    app = _App(conf)

    def reconfigure() -> None:
        conf["redlock_ttl"] = 45
        reset_settings(app)

    _race(lambda: get_settings(app), reconfigure, conf)  # type: ignore[arg-type]
    assert [get_settings(app).ttl for _ in range(3)] == [45, 45, 45]
    reset_settings()


def test_a_reset_during_a_client_lookup_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _Pausing(unless_held=client_module._lock)
    monkeypatch.setattr(client_module, "_clients", cache)
    reset_settings()
    app = _App({"redlock_backend": "memory"})
    first = redlock_for(app)
    first.acquire("job", 30)  # taken before the reset
    redlock_for(_App({"redlock_backend": "memory"}))  # the last answer: another app's
    held: list[object] = []  # the racing caller keeps its client, as a running task does
    try:
        _race(lambda: held.append(redlock_for(app)), reset_clients, cache)
        after = redlock_for(app)
        assert after is not first
        after.acquire("job", 30).release()
    finally:
        reset_clients()
        reset_settings()


def test_settings_are_read_again_when_a_replaced_conf_is_put_back() -> None:
    reset_settings()
    first = _Conf(redlock_backend="memory", redlock_ttl=30)
    app = _App(first)
    assert get_settings(app).ttl == 30
    app.conf = {"redlock_backend": "memory", "redlock_ttl": 60}  # takes no weak reference
    assert get_settings(app).ttl == 60
    first["redlock_ttl"] = 45
    app.conf = first  # put back (a monkeypatch undo)
    assert get_settings(app).ttl == 45
    reset_settings()


def test_settings_go_with_their_app() -> None:
    reset_settings()
    master = redis.Redis(host="127.0.0.1", port=1)  # never connected
    app = _App(_Conf(redlock_redis_urls=[master]))
    kept = weakref.ref(get_settings(app)), weakref.ref(master)
    del app, master
    gc.collect()
    assert [ref() for ref in kept] == [None, None]


class _ItemsOnly:
    """Enough of a mapping for meta: .items()."""

    def items(self) -> list[tuple[str, str]]:
        return [("who", "me")]


@pytest.mark.parametrize("meta", [[("who", "me")], ["ab"], "ab", 5], ids=repr)
def test_meta_that_is_no_mapping_is_refused(meta: Any) -> None:
    with pytest.raises(AttributeError):
        MemoryRedlock().acquire("k", 30, meta=meta)


def test_meta_with_only_items_is_taken() -> None:
    redlock = MemoryRedlock()
    redlock.acquire("k", 30, meta=_ItemsOnly())
    assert redlock._meta[redlock.lock_key("k") + ":meta"] == {"who": "me"}
