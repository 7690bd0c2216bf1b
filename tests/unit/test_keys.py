"""Lock keys: which calls share a lock, what operators read in Redis, and what is refused."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import json
import os
import socket
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from redis.crc import key_slot

from celery_redlock.exceptions import ImproperlyConfigured
from celery_redlock.keys import (
    KeyArgumentError,
    arguments_digest,
    bind_arguments,
    canonical_bytes,
    cap_key,
    compile_lock_key,
    occurrence_key,
    redis_key,
    split_redis_key,
    validate_prefix,
)

ROOT = Path(__file__).resolve().parents[2]
UTC = dt.timezone.utc
# Naive on purpose: a naive and an aware datetime must never share a key.
NAIVE = dt.datetime(2024, 5, 1, 3)  # noqa: DTZ001


def sync(account_id: Any, day: Any = None, *, full: Any = False) -> None:
    """A stand-in task body."""


def one(value: Any) -> None:
    """A task taking a single argument."""


def key_of(value: Any) -> str:
    return compile_lock_key(None, one, "proj.one")((value,), {})


# -- binding ------------------------------------------------------------------------------


def test_positional_keyword_and_default_spellings_of_one_call_bind_alike() -> None:
    expected = {"account_id": 42, "day": None, "full": False}
    assert bind_arguments(sync, (42,), {}) == expected
    assert bind_arguments(sync, (), {"account_id": 42}) == expected
    assert bind_arguments(sync, (42, None), {"full": False}) == expected


def test_catch_all_keywords_are_merged_by_name_and_extra_positionals_kept() -> None:
    def task(a: Any, *rest: Any, **extra: Any) -> None: ...

    bound = bind_arguments(task, (1, 2, 3), {"region": "eu", "tier": 2})
    assert bound == {"a": 1, "rest": (2, 3), "region": "eu", "tier": 2}


def test_a_bound_run_method_binds_without_self() -> None:
    class Task:
        def run(self, account_id: Any) -> None: ...

    assert bind_arguments(Task().run, (7,), {}) == {"account_id": 7}


def test_arguments_that_do_not_fit_the_signature_raise_type_error() -> None:
    with pytest.raises(TypeError):
        bind_arguments(sync, (), {})
    with pytest.raises(TypeError):
        bind_arguments(sync, (1,), {"nope": 2})


def test_the_fast_binder_agrees_with_signature_bind() -> None:
    import inspect

    from celery_redlock.keys import _bind, _binder

    def plain(a: int, b: int = 2, *, c: int = 3, d: int) -> None: ...

    signature = inspect.signature(plain)
    bind = _binder(signature)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {"d": 4}),
        ((1, 5), {"d": 4, "c": 0}),
        ((), {"a": 1, "d": 4}),
        ((), {"d": 4, "b": 7, "a": 1}),
    ]
    for args, kwargs in calls:
        assert bind(args, kwargs) == _bind(signature, args, kwargs)
    bad: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}),  # d missing
        ((1, 2, 3), {"d": 4}),  # too many positionals
        ((1,), {"a": 1, "d": 4}),  # a twice
        ((1,), {"d": 4, "e": 5}),  # unknown name
    ]
    for args, kwargs in bad:
        with pytest.raises(TypeError):
            bind(args, kwargs)


# -- the default key ----------------------------------------------------------------------


def test_default_key_is_task_name_and_a_digest_of_the_arguments() -> None:
    build = compile_lock_key(None, sync, "proj.sync")
    key = build((42,), {})
    name, _, digest = key.partition(":")
    assert name == "proj.sync"
    assert len(digest) == 32
    assert int(digest, 16) >= 0
    assert build((), {"account_id": 42, "full": False}) == key
    assert build((43,), {}) != key
    assert build((42,), {"full": True}) != key


def test_default_key_digest_is_pinned() -> None:
    # Keys written by one release must be found by the next (dedupe markers, held locks
    # during a rolling deploy): changing the encoding must be deliberate.
    # (Moved once, deliberately, when arguments left at their default left the key.)
    build = compile_lock_key(None, sync, "proj.sync")
    assert build((42,), {"day": "2024-05-01"}) == "proj.sync:d52d76e049628e918cfc55c0416abea3"


def test_adding_an_optional_parameter_keeps_the_keys_of_calls_that_do_not_pass_it() -> None:
    # A rolling deploy: old workers run v1, new ones v2; both must build the same key for
    # the calls both can receive, or they would not exclude each other.
    def v1(account_id: Any, day: Any = None) -> None: ...

    def v2(account_id: Any, day: Any = None, dry_run: bool = False, note: str = "") -> None: ...

    old = compile_lock_key(None, v1, "proj.sync")
    new = compile_lock_key(None, v2, "proj.sync")
    assert new((42,), {}) == old((42,), {})
    assert new((42, "2024-05-01"), {}) == old((42,), {"day": "2024-05-01"})
    assert new((42,), {"dry_run": False}) == old((42,), {})  # the default, passed explicitly
    assert new((42,), {"dry_run": True}) != old((42,), {})
    # 0 is not False, 0.0 is not 0: only a value of the default's own type is the default.
    assert new((42,), {"dry_run": 0}) != new((42,), {})


def test_task_without_arguments_is_keyed_by_its_name() -> None:
    def nightly() -> None: ...

    assert compile_lock_key(None, nightly, "proj.nightly")((), {}) == "proj.nightly"


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (1, 1.0),
        (1, Decimal("1.000")),
        (Decimal("0.10"), Decimal("0.1")),
        (0.5, Decimal("0.5")),
        (-0.0, 0),
        ((1, 2), [1, 2]),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({1: "x"}, {"1": "x"}),
        ({True: "x"}, {"true": "x"}),
        ({1, 2, 3}, frozenset({3, 2, 1})),
        (
            dt.datetime(2024, 5, 1, 3, tzinfo=UTC),
            dt.datetime(2024, 5, 1, 5, tzinfo=ZoneInfo("Europe/Paris")),
        ),
        (float("nan"), float("nan")),
    ],
)
def test_equal_values_share_a_key(left: Any, right: Any) -> None:
    assert key_of(left) == key_of(right)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (True, 1),
        (False, 0),
        ("1", 1),
        (b"1", "1"),
        (None, "None"),
        (None, 0),
        (0.1, Decimal("0.1")),
        (1, 1.5),
        ({1: "x"}, {1.0: "x"}),
        ([1, 2], [2, 1]),
        ([[1], 2], [1, [2]]),
        (["ab", "c"], ["a", "bc"]),
        ({"a": None}, {}),
        (NAIVE, NAIVE.replace(tzinfo=UTC)),
        (dt.date(2024, 5, 1), "2024-05-01"),
        (dt.date(2024, 5, 1), NAIVE.replace(hour=0)),
        (dt.timedelta(seconds=1), 1),
        (uuid.UUID(int=1), uuid.UUID(int=1).hex),
        (float("inf"), float("-inf")),
    ],
)
def test_different_values_get_different_keys(left: Any, right: Any) -> None:
    assert key_of(left) != key_of(right)


class Color(enum.IntEnum):
    RED = 1


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Point:
    x: int
    y: int
    note: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass
class Size:
    x: int
    y: int


class Account:
    def __init__(self, pk: int, name: str) -> None:
        self.pk = pk
        self.name = name

    def __redlock_key__(self) -> object:
        return self.pk


def test_enum_members_are_keyed_by_their_value() -> None:
    assert key_of(Color.RED) == key_of(1)
    assert key_of(Mode.FAST) == key_of("fast")


def test_dataclasses_are_keyed_by_class_and_compared_fields() -> None:
    assert key_of(Point(1, 2, note="a")) == key_of(Point(1, 2, note="b"))
    assert key_of(Point(1, 2)) != key_of(Point(2, 1))
    assert key_of(Point(1, 2)) != key_of(Size(1, 2))


def test_objects_can_name_their_identity_with_redlock_key() -> None:
    assert key_of(Account(7, "a")) == key_of(Account(7, "renamed"))
    assert key_of(Account(7, "a")) != key_of(Account(8, "a"))
    assert key_of(Account(7, "a")) != key_of(7)


def test_supported_scalar_types_make_keys() -> None:
    values = [
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        dt.time(3, 30, tzinfo=UTC),
        dt.timedelta(days=2, microseconds=5),
        Decimal("-12.5E-3"),
        Decimal("Infinity"),
        bytearray(b"\x00\xff"),
        2**20000,
        "\ud800",  # a lone surrogate is still a str a task can receive
    ]
    keys = {key_of(value) for value in values}
    assert len(keys) == len(values)


def test_key_survives_the_json_round_trip_of_a_celery_message() -> None:
    # The publisher (enqueue dedupe) and the worker (run-time lock) must agree on the key,
    # although the worker sees the arguments after kombu's json serializer.
    args = [
        (1, 2),
        {1: "one", "two": (2,)},
        Color.RED,
        dt.datetime(2024, 5, 1, 3, 0, 0, 123456, tzinfo=ZoneInfo("America/New_York")),
        dt.date(2024, 5, 1),
        dt.time(1, 2, 3),
        Decimal("10.50"),
        uuid.UUID(int=42),
        b"raw",
        None,
        True,
        1.25,
    ]
    build = compile_lock_key(None, one, "proj.one")
    for value in args:
        received = kombu_loads(kombu_dumps([value]))
        assert build((value,), {}) == build(tuple(received), {}), value


def test_unsupported_argument_is_named_with_task_and_remedy() -> None:
    def push(conn: Any, account_id: int) -> None: ...

    build = compile_lock_key(None, push, "proj.sync")
    with socket.socket() as conn, pytest.raises(KeyArgumentError) as caught:
        build((conn, 1), {})
    assert str(caught.value) == (
        "cannot build a lock key from argument 'conn' of task 'proj.sync': type socket is not "
        "supported; pass unique_on=[...] or a lock_key"
    )
    # Both a configuration error and a TypeError, whichever the caller catches.
    assert isinstance(caught.value, ImproperlyConfigured)
    assert isinstance(caught.value, TypeError)
    # Celery's result backends rebuild exceptions as cls(*args).
    rebuilt = type(caught.value)(*caught.value.args)
    assert str(rebuilt) == str(caught.value)


def test_unsupported_value_deep_inside_an_argument_names_its_path() -> None:
    with pytest.raises(KeyArgumentError, match=r"argument 'value' .* \(at value\[1\]\['k'\]\)"):
        key_of([1, {"k": object()}])


def test_a_value_containing_itself_is_refused_not_recursed_forever() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(KeyArgumentError, match="contains itself"):
        key_of(loop)


def test_unique_on_keys_only_the_named_arguments() -> None:
    build = compile_lock_key(None, sync, "proj.sync", unique_on=["account_id"])
    assert build((42, "2024-05-01"), {}) == build((42, "2024-05-02"), {"full": True})
    assert build((42,), {}) != build((43,), {})


def test_empty_unique_on_keys_by_task_name_alone() -> None:
    build = compile_lock_key(None, sync, "proj.sync", unique_on=[])
    assert build((42,), {}) == "proj.sync"
    # The arguments need not even be encodable.
    assert build((object(),), {}) == "proj.sync"


def test_unique_on_ignores_unsupported_arguments_it_does_not_name() -> None:
    def push(conn: Any, account_id: int) -> None: ...

    build = compile_lock_key(None, push, "proj.push", unique_on=["account_id"])
    assert build((object(), 5), {}) == build((object(), 5), {})


def test_unique_on_naming_a_missing_argument_fails_at_compile_time() -> None:
    with pytest.raises(ImproperlyConfigured) as caught:
        compile_lock_key(None, sync, "proj.sync", unique_on=["acount_id"])
    message = str(caught.value)
    assert "'proj.sync'" in message
    assert "'acount_id'" in message
    assert "did you mean 'account_id'?" in message
    assert "valid names: account_id, day, full" in message


def test_unique_on_as_a_bare_string_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"write unique_on=\['account_id'\]"):
        compile_lock_key(None, sync, "proj.sync", unique_on="account_id")


def test_unique_on_may_name_catch_all_keywords() -> None:
    def task(**options: Any) -> None: ...

    build = compile_lock_key(None, task, "proj.t", unique_on=["region"])
    assert build((), {"region": "eu", "x": 1}) == build((), {"region": "eu", "x": 2})
    assert build((), {"region": "eu"}) != build((), {"region": None})
    assert build((), {}) != build((), {"region": None})


# -- lock_key templates and callables -------------------------------------------------------


def test_template_key_is_the_formatted_text_verbatim() -> None:
    build = compile_lock_key("report:{account_id}", sync, "proj.sync")
    assert build((42,), {}) == "report:42"
    assert build((), {"account_id": "acme", "day": 3}) == "report:acme"


def test_template_may_use_attributes_indexes_and_format_specs() -> None:
    @dataclasses.dataclass
    class Acct:
        id: int

    def task(account: Any, d: Any, n: Any) -> None: ...

    build = compile_lock_key("{account.id}/{d[region]}/{n:04d}", task, "proj.t")
    assert build((Acct(9), {"region": "eu"}, 7), {}) == "9/eu/0007"


def test_template_fields_are_checked_at_compile_time() -> None:
    with pytest.raises(ImproperlyConfigured) as caught:
        compile_lock_key("report:{acount_id}", sync, "proj.sync")
    message = str(caught.value)
    assert "lock_key 'report:{acount_id}' of task 'proj.sync'" in message
    assert "'acount_id', which is not an argument of the task" in message
    assert "valid names: account_id, day, full" in message


def test_template_fields_nested_in_format_specs_are_checked_too() -> None:
    with pytest.raises(ImproperlyConfigured, match="'width'"):
        compile_lock_key("{account_id:>{width}}", sync, "proj.sync")


@pytest.mark.parametrize("template", ["report:{}", "report:{0}"])
def test_positional_template_fields_are_refused(template: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="positional field"):
        compile_lock_key(template, sync, "proj.sync")


@pytest.mark.parametrize("template", ["report:{account_id", "report:}"])
def test_malformed_templates_are_refused(template: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="not a valid format string"):
        compile_lock_key(template, sync, "proj.sync")


def test_template_that_cannot_be_formatted_for_a_call_says_why() -> None:
    def task(account: Any) -> None: ...

    build = compile_lock_key("{account.id}", task, "proj.t")
    with pytest.raises(ImproperlyConfigured, match=r"cannot be formatted .*AttributeError"):
        build(({"id": 1},), {})


def test_lock_key_and_unique_on_together_are_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="both lock_key and unique_on"):
        compile_lock_key("r:{account_id}", sync, "proj.sync", unique_on=["account_id"])


def test_callable_lock_key_receives_the_task_arguments() -> None:
    seen: list[tuple[Any, ...]] = []

    def key(account_id: Any, day: Any = None, **kwargs: Any) -> str:
        seen.append((account_id, day, kwargs))
        return f"acct:{account_id}"

    build = compile_lock_key(key, sync, "proj.sync")
    assert build((5,), {"full": True}) == "acct:5"
    assert seen == [(5, None, {"full": True})]


@pytest.mark.parametrize("result", ["", None, 42, b"k"])
def test_callable_lock_key_must_return_a_non_empty_str(result: object) -> None:
    build = compile_lock_key(lambda *a, **k: result, sync, "proj.sync")
    with pytest.raises(ImproperlyConfigured, match="must be a non-empty str"):
        build((1,), {})


@pytest.mark.parametrize("lock_key", ["", 42])
def test_empty_or_mistyped_lock_key_is_refused(lock_key: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"lock_key of task 'proj\.sync'"):
        compile_lock_key(lock_key, sync, "proj.sync")


# -- Redis key names ---------------------------------------------------------------------


def test_redis_key_wraps_the_lock_key_in_a_hash_tag() -> None:
    assert redis_key("redlock", "report:42") == "redlock:{report:42}"
    assert redis_key("redlock", "report:42", "fence") == "redlock:{report:42}:fence"


@pytest.mark.parametrize("key", ["report:42", "proj.sync:8d1b9a55", "a}b", "{x}"])
def test_every_key_of_one_lock_shares_a_cluster_slot(key: str) -> None:
    names = [redis_key("redlock", key)] + [
        redis_key("redlock", key, suffix) for suffix in ("fence", "meta", "dedupe")
    ]
    assert len({key_slot(name.encode()) for name in names}) == 1


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "my app", 5])
def test_invalid_prefixes_are_refused(prefix: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="prefix"):
        redis_key(prefix, "k")
    with pytest.raises(ImproperlyConfigured):
        validate_prefix(prefix)


@pytest.mark.parametrize(("key", "suffix"), [("", None), ("}x", None), ("k", ""), ("k", "a{b")])
def test_empty_keys_and_bad_suffixes_are_refused(key: str, suffix: str | None) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        redis_key("redlock", key, suffix)


@pytest.mark.parametrize(
    ("key", "suffix"), [("report:42", None), ("report:42", "fence"), ("a}:b", "meta")]
)
def test_split_redis_key_inverts_redis_key(key: str, suffix: str | None) -> None:
    assert split_redis_key("redlock", redis_key("redlock", key, suffix)) == (key, suffix)


@pytest.mark.parametrize("name", ["other:{k}", "redlock:k", "redlock:{}", "redlock:{k}x"])
def test_split_redis_key_rejects_foreign_names(name: str) -> None:
    assert split_redis_key("redlock", name) is None


# -- beat occurrences --------------------------------------------------------------------


def test_occurrence_key_is_the_same_instant_from_any_zone() -> None:
    utc = dt.datetime(2024, 5, 1, 3, 0, tzinfo=UTC)
    paris = utc.astimezone(ZoneInfo("Europe/Paris"))
    assert occurrence_key("nightly", utc) == "beat:nightly@2024-05-01T03:00:00.000Z"
    assert occurrence_key("nightly", paris) == occurrence_key("nightly", utc)
    assert occurrence_key("nightly", utc.timestamp()) == occurrence_key("nightly", utc)


def test_occurrence_key_rounds_to_the_millisecond() -> None:
    base = dt.datetime(2024, 5, 1, 3, 0, tzinfo=UTC).timestamp()
    assert occurrence_key("e", base + 0.0004) == occurrence_key("e", base)
    assert occurrence_key("e", base + 0.0006).endswith("03:00:00.001Z")
    due = dt.datetime(2024, 5, 1, 3, 0, 0, 999_700, tzinfo=UTC)
    assert occurrence_key("e", due).endswith("03:00:01.000Z")
    assert occurrence_key("a", base) != occurrence_key("b", base)


def test_occurrence_key_refuses_naive_datetimes() -> None:
    with pytest.raises(ValueError, match="naive"):
        occurrence_key("nightly", NAIVE)
    with pytest.raises(ValueError, match="entry name"):
        occurrence_key("", 0.0)


# -- stability across processes ----------------------------------------------------------

_STABILITY_SCRIPT = """
import datetime as dt, json, sys, uuid
from decimal import Decimal
from celery_redlock.keys import arguments_digest
values = {
    "strings": {"beta", "alpha", "gamma", "delta"},
    "nested": {"z": [1, 2.5, None], "a": frozenset({"x", "y"}), 3: b"\\x00"},
    "when": dt.datetime(2024, 5, 1, 3, 0, 0, 5, tzinfo=dt.timezone.utc),
    "id": uuid.UUID(int=99),
    "amount": Decimal("12.30"),
    "span": dt.timedelta(hours=1),
}
print(json.dumps({name: arguments_digest({name: v}) for name, v in values.items()}))
"""


def _digests_in_subprocess(hash_seed: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", _STABILITY_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    digests: dict[str, str] = json.loads(result.stdout)
    return digests


def test_keys_are_identical_in_other_processes_and_hash_seeds() -> None:
    namespace: dict[str, Any] = {}
    exec(_STABILITY_SCRIPT.replace("print(", "result = ("), namespace)
    here: dict[str, str] = json.loads(namespace["result"])
    assert _digests_in_subprocess("1") == here
    assert _digests_in_subprocess("2") == here


def test_digest_ignores_argument_order() -> None:
    assert arguments_digest({"a": 1, "b": 2}) == arguments_digest({"b": 2, "a": 1})
    assert arguments_digest({"a": 1, "b": 2}) != arguments_digest({"a": 2, "b": 1})


# -- the length cap of template and callable keys ----------------------------------------------


@given(st.text(min_size=1, max_size=600).filter(lambda k: not k.startswith("}")))
def test_long_keys_are_capped_deterministically(key: str) -> None:
    from celery_redlock.keys import MAX_KEY_LENGTH, cap_key

    def task(key: str) -> None: ...

    capped = compile_lock_key("{key}", task, "t")((key,), {})
    assert capped == cap_key(key) == compile_lock_key(lambda key: key, task, "t")((key,), {})
    if len(key) <= MAX_KEY_LENGTH:
        assert capped == key  # verbatim, as documented
    else:
        assert len(capped) == MAX_KEY_LENGTH
        assert capped.startswith(key[:160])  # a readable prefix
        assert cap_key(key + "x") != capped  # the hash covers the whole key


def test_keys_differing_only_past_the_prefix_stay_apart() -> None:
    from celery_redlock.keys import cap_key

    one = "batch:" + str(list(range(20_000)))
    other = "batch:" + str([*range(19_999), 20_001])
    assert len(one) > 100_000
    assert cap_key(one) != cap_key(other)
    assert cap_key(one)[:160] == cap_key(other)[:160]


# -- !h: a digest instead of the value ------------------------------------------------------


def test_a_hashed_field_keeps_the_value_out_of_the_key() -> None:
    def notify(email: Any, kind: Any) -> None: ...

    build = compile_lock_key("notify:{kind}:{email!h}", notify, "proj.notify")
    key = build(("ann@example.com", "welcome"), {})
    assert key.startswith("notify:welcome:")
    assert "ann" not in key
    assert "example" not in key
    digest = key.rsplit(":", 1)[1]
    assert len(digest) == 16
    assert int(digest, 16) >= 0
    assert build((), {"email": "ann@example.com", "kind": "welcome"}) == key
    assert build(("bob@example.com", "welcome"), {}) != key
    # The digest is of the canonical encoding, so wire-equal values hash alike.
    assert compile_lock_key("{v!h}", lambda v: None, "t")(((1, 2),), {}) == compile_lock_key(
        "{v!h}", lambda v: None, "t"
    )(([1, 2],), {})


def test_a_hashed_field_digest_is_pinned() -> None:
    # Keys must be the same in every process and release: changing the digest is deliberate.
    build = compile_lock_key("u:{email!h}", lambda email: None, "proj.u")
    assert build(("ann@example.com",), {}) == "u:e394c751343899a3"


def test_an_unknown_conversion_is_refused_at_definition() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"unknown conversion !x .*!r, !s, !a and !h"):
        compile_lock_key("u:{email!x}", lambda email: None, "proj.u")


# -- hostile review r9 -------------------------------------------------------------------


def test_a_huge_whole_decimal_is_refused_at_once_not_converted_for_minutes() -> None:
    """Review r9: ``int(Decimal("1e1000000"))`` (to key it as the equal int) takes about
    half a minute, quadratic in its digits: a nine-character argument blocked every
    publish and every run of its job."""

    def pay(amount: object) -> None: ...

    build = compile_lock_key(None, pay, "shop.pay")
    with pytest.raises(
        KeyArgumentError, match=r"a whole number of 1000001 digits \(at most 4300\)"
    ):
        build((Decimal("1e1000000"),), {})
    with pytest.raises(KeyArgumentError, match="amount"):
        canonical_bytes(Decimal("-9e4300"), argument="amount")
    # Below the limit a whole Decimal still keys as the equal int, and fractions are free.
    assert build((Decimal("1e4299"),), {}) == build((10**4299,), {})
    assert build((Decimal("1.5e-1000000"),), {}) != build((Decimal("1.5e-999999"),), {})


def test_a_kwargs_entry_named_like_a_parameter_is_another_argument() -> None:
    """Review r9: ``**kwargs`` entries overwrote same-named parameters in the default key,
    so distinct jobs were taken for duplicates (and never ran)."""

    def render(template: str, /, **values: object) -> None: ...

    def call(*args: object, **kwargs: object) -> None: ...

    def plain(a: int, **rest: object) -> None: ...

    r = compile_lock_key(None, render, "mail.render")
    keys = {
        r(("invoice.html",), {"template": "A"}),
        r(("receipt.html",), {"template": "A"}),
        r(("A",), {}),
        r(("A",), {"**": "A"}),
    }
    assert len(keys) == 4
    c = compile_lock_key(None, call, "rpc.call")
    assert c((1, 2), {}) != c((), {"args": [1, 2]})
    # Calls whose entries never collided keep the key they always had.
    p = compile_lock_key(None, plain, "t.plain")
    assert p((1,), {"b": 2}) == f"t.plain:{arguments_digest({'a': 1, 'b': 2}, task_name='t.plain')}"


SET_KEYS = """
import pickle, sys
from celery_redlock.keys import compile_lock_key
def retag(tags, order=None): ...
tags = pickle.loads(bytes.fromhex(sys.argv[1]))
print(compile_lock_key("tags:{tags}", retag, "r")((tags,), {}))
print(compile_lock_key("tags:{order[t]!s}", retag, "r")((None, {"t": [tags, {tags}]}), {}))
"""


def test_a_template_over_a_set_gives_every_process_the_same_key() -> None:
    """Review r9: a set's text follows its hash order, which differs between processes
    (``PYTHONHASHSEED``) and between a set and its unpickled copy: with ``"tags:{tags}"``
    the publisher and each worker built other keys (a marker never cleared, and two runs
    of the same tags at once)."""
    import pickle

    tags = frozenset({"green", "cyan", "red", "mauve", "blue", "teal", "plum"})
    wire = pickle.dumps(tags).hex()
    outputs = set()
    for seed in ("1", "2", "3", "4"):
        done = subprocess.run(
            [sys.executable, "-c", SET_KEYS, wire],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        outputs.add(done.stdout)
    assert len(outputs) == 1, outputs
    first, nested = outputs.pop().splitlines()
    assert first == "tags:frozenset({'blue', 'cyan', 'green', 'mauve', 'plum', 'red', 'teal'})"
    assert "frozenset({'blue'" in nested


@given(st.frozensets(st.text(max_size=3), max_size=8), st.sets(st.integers(), max_size=8))
def test_a_templates_text_for_a_set_lists_its_items_in_a_fixed_order(
    strings: frozenset[str], numbers: set[int]
) -> None:
    def job(a: object, b: object) -> None: ...

    def shown(items: frozenset[str] | set[int], empty: str, frame: str) -> str:
        return frame.format(", ".join(sorted(map(repr, items)))) if items else empty

    key = compile_lock_key("{a}|{b!r}", job, "t.sets")((strings, [numbers]), {})
    a = shown(strings, "frozenset()", "frozenset({{{}}})")
    b = "{" + ", ".join(map(repr, sorted(numbers))) + "}" if numbers else "set()"
    assert key == cap_key(f"{a}|[{b}]")


class _SortedTags(frozenset[str]):
    def __str__(self) -> str:
        return ",".join(sorted(self))

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _CaselessEmails(frozenset[str]):
    def __redlock_key__(self) -> object:
        return sorted(email.lower() for email in self)


def test_the_r9_fixes_leave_the_keys_of_calls_that_were_already_right_unchanged() -> None:
    """Review r11: the first r9 fixes changed keys that never collided or never depended
    on a process (a rolling deploy's old and new workers would not have excluded each
    other): a **kwargs entry named like the **kwargs parameter, sets of ints, a set
    subclass's own text, a !h field's key hook; and refused a Decimal zero with a large
    exponent, and a value that contains itself. Each key here is what 718c347 gave (a set
    of ints shows sorted: its own order depends on how it was built, review r13)."""

    def sync(**options: object) -> None: ...

    def tags(tags: object) -> None: ...

    looped: list[object] = [1]
    looped.append(looped)
    cases = [
        (compile_lock_key(None, sync, "t.sync"), (), {"options": 1},
         "t.sync:201606131140c0e89abdefd46f7dd529"),
        (compile_lock_key("sync:{options}", sync, "t.sync"), (), {"options": 1}, "sync:1"),
        (compile_lock_key("tags:{tags}", tags, "t"), ({2, 10},), {}, "tags:{2, 10}"),
        (compile_lock_key("tags:{tags}", tags, "t"), (set(range(1, 13)),), {},
         "tags:{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}"),
        (compile_lock_key("tags:{tags}", tags, "t"), (frozenset({(1, 2), (3, 4)}),), {},
         "tags:frozenset({(1, 2), (3, 4)})"),
        (compile_lock_key("tags:{tags}", tags, "t"), (_SortedTags({"a", "b", "c"}),), {},
         "tags:a,b,c"),
        (compile_lock_key(None, tags, "t"), (Decimal("0E+5000"),), {},
         "t:f394008646f02d7eeeb840bfc02c6cde"),
        (compile_lock_key("x:{tags}", tags, "t"), (looped,), {}, "x:[1, [...]]"),
    ]  # fmt: skip
    for build, args, kwargs, key in cases:
        assert build(args, kwargs) == key
    shown = compile_lock_key("tags:{tags}", tags, "t")
    assert shown(({1, 9},), {}) == shown(({9, 1},), {}) == "tags:{1, 9}"  # review r13
    # A !h field keys a value through its own __redlock_key__ hook.
    hashed = compile_lock_key("notify:{tags!h}", tags, "t")
    assert hashed((_CaselessEmails({"A@x.org"}),), {}) == hashed(
        (_CaselessEmails({"a@x.org"}),), {}
    )
