"""Settings read from app.conf: defaults, both spellings, and the errors users see."""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, Task

from celery_redlock.backoff import Backoff
from celery_redlock.exceptions import ImproperlyConfigured
from celery_redlock.settings import (
    UNSET,
    RedlockSettings,
    default_redis_url,
    describe_master,
    find_unknown_settings,
    get_settings,
    mask_url,
    reset_settings,
    settings_from_conf,
    validate_call_options,
    validate_task_options,
)

THREE = ["redis://r1:6379/0", "redis://r2:6379/0", "redis://r3:6379/0"]


@pytest.fixture(autouse=True)
def _no_broker_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Celery reads $CELERY_BROKER_URL before app.conf; the defaults must not depend on it.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    yield
    reset_settings()


def make_app(broker: str | None = None, **conf: Any) -> Celery:
    app = Celery("proj", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


def django_app(**settings: Any) -> Celery:
    """An app configured the Django way: config_from_object(..., namespace="CELERY")."""
    app = Celery("proj", set_as_current=False)
    app.config_from_object(types.SimpleNamespace(**settings), namespace="CELERY")
    return app


def error_of(**conf: Any) -> str:
    with pytest.raises(ImproperlyConfigured) as caught:
        get_settings(make_app(**conf))
    return str(caught.value)


# -- defaults and reading ------------------------------------------------------------------


def test_defaults_match_the_documented_ones() -> None:
    settings = get_settings(make_app())
    assert settings.redis_urls == ("redis://localhost:6379/0",)
    assert settings.key_prefix == "redlock"
    assert settings.node_timeout == 0.25
    assert settings.ttl == 30
    assert settings.renew_every is None
    assert settings.renew_interval(30) == 10
    assert settings.renew_interval(9) == 3
    assert settings.clock_drift_factor == 0.01
    assert settings.on_contention == "retry"
    assert settings.contention_backoff == Backoff(1, 60)
    assert settings.max_contention_retries is None
    assert settings.dedupe == "queued"
    assert settings.dedupe_ttl == 3600
    assert settings.on_lock_lost == "log"
    assert settings.outage_backoff == Backoff(1, 10)
    assert settings.beat_leader is True
    assert settings.beat_lease_ttl == 10
    assert settings == RedlockSettings()


def test_lower_case_settings_are_read_from_app_conf() -> None:
    settings = get_settings(
        make_app(
            redlock_redis_urls=THREE,
            redlock_key_prefix="myapp",
            redlock_ttl=60,
            redlock_renew_every=5,
            redlock_on_contention="skip",
            redlock_contention_backoff=[2, 30],
            redlock_max_contention_retries=0,
            redlock_dedupe=None,
            redlock_on_lock_lost="interrupt",
            redlock_beat_leader=False,
        )
    )
    assert settings.redis_urls == tuple(THREE)
    assert settings.key_prefix == "myapp"
    assert settings.ttl == 60
    assert settings.renew_interval(60) == 5
    assert settings.on_contention == "skip"
    assert settings.contention_backoff == Backoff(2, 30)
    assert settings.max_contention_retries == 0
    assert settings.dedupe is None
    assert settings.on_lock_lost == "interrupt"
    assert settings.beat_leader is False


def test_django_spelling_is_read_through_the_celery_namespace() -> None:
    settings = get_settings(
        django_app(CELERY_REDLOCK_TTL=12, CELERY_REDLOCK_DEDUPE="active", CELERY_BROKER_URL=None)
    )
    assert settings.ttl == 12
    assert settings.dedupe == "active"


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://:pw@broker:6380/2", "redis://:pw@broker:6380/2"),
        ("rediss://broker:6380/0", "rediss://broker:6380/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("redis://a:6379/0;redis://b:6379/0", "redis://a:6379/0"),
        (["redis://a:6379/0", "redis://b:6379/0"], "redis://a:6379/0"),
        ("redis+socket:///run/redis.sock", "unix:///run/redis.sock"),
        ("amqp://guest@rabbit//", "redis://localhost:6379/0"),
        ("sentinel://s1:26379", "redis://localhost:6379/0"),
        (None, "redis://localhost:6379/0"),
    ],
)
def test_masters_default_to_a_redis_broker(broker: Any, expected: str) -> None:
    assert default_redis_url(broker) == expected


def test_masters_default_to_the_apps_broker_url() -> None:
    settings = get_settings(make_app(broker="redis://broker:6379/5"))
    assert settings.redis_urls == ("redis://broker:6379/5",)


def test_masters_default_to_the_broker_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://from-env:6379/1")
    assert get_settings(make_app()).redis_urls == ("redis://from-env:6379/1",)


def test_explicit_masters_win_over_the_broker() -> None:
    settings = get_settings(make_app(broker="redis://broker/0", redlock_redis_urls=THREE))
    assert settings.redis_urls == tuple(THREE)


def test_every_master_form_is_accepted() -> None:
    client = redis.Redis(host="r4", port=6379)
    masters = [
        "rediss://user:pw@r1:6380/1",
        "unix:///run/redis.sock?db=2",
        {"host": "r2", "port": 6380, "password": "pw", "socket_keepalive": True},
        client,
        {"sentinels": [("s1", 26379), ["s2", 26379]], "service_name": "mymaster"},
    ]
    settings = get_settings(make_app(redlock_redis_urls=masters))
    assert settings.redis_urls[3] is client
    assert len(settings.redis_urls) == 5


def test_a_single_master_may_be_given_without_a_list() -> None:
    settings = get_settings(make_app(redlock_redis_urls="redis://r1:6379/0"))
    assert settings.redis_urls == ("redis://r1:6379/0",)


def test_settings_are_read_once_per_app_and_can_be_reset() -> None:
    app = make_app(redlock_ttl=20)
    first = get_settings(app)
    app.conf.redlock_ttl = 40
    assert get_settings(app) is first
    reset_settings(app)
    assert get_settings(app).ttl == 40
    assert get_settings(make_app()).ttl == 30


def test_replaced_configuration_is_read_again() -> None:
    app = make_app()
    app.config_from_object(types.SimpleNamespace(redlock_ttl=20))
    assert get_settings(app).ttl == 20
    app.config_from_object(types.SimpleNamespace(redlock_ttl=50))
    assert get_settings(app).ttl == 50


def test_settings_from_a_plain_mapping() -> None:
    settings = settings_from_conf({"redlock_ttl": 9, "broker_url": "redis://b:1/0"})
    assert settings.ttl == 9
    assert settings.redis_urls == ("redis://b:1/0",)


# -- invalid values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value", "accepted"),
    [
        ("node_timeout", 0, "must be a number of seconds in (0, 60]"),
        ("node_timeout", -1, "must be a number of seconds in (0, 60]"),
        ("ttl", 0.001, "must be a number of seconds in [0.01, 86400]"),
        ("ttl", math.inf, "must be a number of seconds in [0.01, 86400]"),
        ("ttl", math.nan, "must be a number of seconds in [0.01, 86400]"),
        ("ttl", 1e12, "must be a number of seconds in [0.01, 86400]"),
        ("renew_every", 1e-6, "must be a number of seconds in [0.01, 86400]"),
        ("node_timeout", math.nan, "must be a number of seconds in (0, 60]"),
        ("dedupe_ttl", 1e12, "must be a number of seconds in (0, 34560000]"),
        ("contention_backoff", (1, 1e12), "must be a pair (base, cap) of seconds"),
        ("renew_every", 0, "must be a number of seconds in [0.01, 86400]"),
        ("clock_drift_factor", 0.5, "must be a number in [0, 0.5)"),
        ("clock_drift_factor", -0.1, "must be a number in [0, 0.5)"),
        ("on_contention", "wait", "must be one of 'retry', 'skip', 'raise'"),
        ("on_contention", None, "must be one of 'retry', 'skip', 'raise'"),
        ("dedupe", "always", "must be one of 'queued', 'active', None"),
        ("dedupe", False, "must be one of 'queued', 'active', None"),
        ("on_lock_lost", "raise", "must be one of 'log', 'interrupt'"),
        ("contention_backoff", (60, 1), "must be a pair (base, cap) of seconds"),
        ("outage_backoff", 5, "must be a pair (base, cap) of seconds"),
        ("max_contention_retries", -1, "must be None (no limit) or an int >= 0"),
        ("max_contention_retries", 2.0, "must be None (no limit) or an int >= 0"),
        ("dedupe_ttl", 0, "must be a number of seconds in (0, 34560000]"),
        ("beat_leader", "yes", "must be True or False"),
        ("beat_leader", 1, "must be True or False"),
        ("beat_lease_ttl", 0, "must be a number of seconds in [0.01, 86400]"),
        ("key_prefix", "my{app}", "must be a non-empty str without '{', '}' or whitespace"),
        ("key_prefix", "", "must be a non-empty str without '{', '}' or whitespace"),
        ("redis_urls", [], "must be a non-empty list of masters"),
    ],
)
def test_invalid_values_name_the_setting_in_both_spellings(
    setting: str, value: Any, accepted: str
) -> None:
    message = error_of(**{f"redlock_{setting}": value})
    assert f"redlock_{setting} (Django: CELERY_REDLOCK_{setting.upper()})" in message
    assert accepted in message
    assert "got " in message


def test_numbers_given_as_strings_are_refused_not_converted() -> None:
    message = error_of(redlock_ttl="30")
    assert message == (
        "redlock_ttl (Django: CELERY_REDLOCK_TTL) must be a number of seconds in [0.01, 86400] "
        "(int or float), not a str (strings are not converted); got '30' (a str)"
    )


@pytest.mark.parametrize("setting", ["ttl", "node_timeout", "dedupe_ttl", "clock_drift_factor"])
def test_bools_are_not_numbers(setting: str) -> None:
    assert "must be a number" in error_of(**{f"redlock_{setting}": True})


def test_node_timeout_must_be_well_below_the_ttl() -> None:
    message = error_of(redlock_ttl=3, redlock_node_timeout=1)
    assert "redlock_node_timeout (Django: CELERY_REDLOCK_NODE_TIMEOUT)" in message
    assert "redlock_ttl (Django: CELERY_REDLOCK_TTL)" in message
    assert "less than a third of it (< 1)" in message
    get_settings(make_app(redlock_ttl=3, redlock_node_timeout=0.9))


def test_node_timeout_must_be_well_below_the_beat_lease() -> None:
    message = error_of(redlock_beat_lease_ttl=0.5, redlock_node_timeout=0.25)
    assert "redlock_beat_lease_ttl (Django: CELERY_REDLOCK_BEAT_LEASE_TTL)" in message


def test_renewal_must_land_before_the_key_expires() -> None:
    message = error_of(redlock_ttl=10, redlock_renew_every=10)
    assert "redlock_renew_every (Django: CELERY_REDLOCK_RENEW_EVERY)" in message
    assert (
        "(the interval must be < 9.398: ttl 10 less its clock drift allowance (0.102) less "
        "two node_timeouts (0.5))" in message
    )
    get_settings(make_app(redlock_ttl=10, redlock_renew_every=9))


def test_every_problem_is_reported_at_once() -> None:
    message = error_of(redlock_ttl="x", redlock_dedupe="nope", redlock_tll=3)
    assert message.startswith("3 problems in the celery-redlock settings:\n- ")
    assert "redlock_ttl" in message
    assert "redlock_dedupe" in message
    assert "redlock_tll" in message


# -- masters -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("master", "reason"),
    [
        ("http://r1:6379/0", "has no redis://, rediss:// or unix:// scheme"),
        ("r1:6379", "has no redis://, rediss:// or unix:// scheme"),
        ("redis://r1:port/0", "has a port that is not a number"),
        ("redis://r1/0?socket_timeout=soon", "has a query argument redis-py cannot parse"),
        ("redis://r1:6379/zero", "where a database number belongs"),
        ("unix://", "names no socket path"),
        ({"host": "r1", "pasword": "x"}, "pasword (did you mean 'password'?)"),
        ({"sentinels": "s1:26379", "service_name": "m"}, "'sentinels' must be a non-empty list"),
        ({"sentinels": [("s1", 26379)]}, "'service_name' must be a non-empty str"),
        (6379, "has an invalid master #1: a int is no master"),
    ],
)
def test_invalid_masters_are_explained(master: Any, reason: str) -> None:
    message = error_of(redlock_redis_urls=[master])
    assert "redlock_redis_urls (Django: CELERY_REDLOCK_REDIS_URLS)" in message
    assert reason in message


def test_a_master_listed_twice_is_refused() -> None:
    message = error_of(redlock_redis_urls=["redis://r1:6379/0", "redis://r2", "redis://R1/0"])
    assert "lists the same master twice (#1 and #3" in message
    assert "breaks the quorum" in message


def _sentinel(*hosts: str, service: str = "mymaster", db: int = 0) -> dict[str, Any]:
    return {"sentinels": [(host, 26379) for host in hosts], "service_name": service, "db": db}


def test_sentinel_masters_are_told_apart_by_their_sentinels() -> None:
    """Review r10: a Sentinel spec was known by its service name alone, and a
    ``Sentinel.master_for()`` client by a host it does not have (localhost:6379), so three
    independent deployments that all call their master ``mymaster`` were refused as one
    master listed three times: the worker could not start."""
    from redis.sentinel import Sentinel

    specs = [_sentinel("dc1-a", "dc1-b"), _sentinel("dc2-a", "dc2-b"), _sentinel("dc3-a")]
    assert len(get_settings(make_app(redlock_redis_urls=specs)).redis_urls) == 3
    clients = [Sentinel([(host, 26379)]).master_for("mymaster") for host in ("s1", "s2", "s3")]
    assert len(get_settings(make_app(redlock_redis_urls=clients)).redis_urls) == 3
    mixed = [clients[0], "redis://localhost:6379/0", "redis://r2"]  # no clash with localhost
    assert len(get_settings(make_app(redlock_redis_urls=mixed)).redis_urls) == 3
    # The same deployment twice (sentinels in another order and case) is still refused,
    # as a spec and as clients; another db of it is another master.
    twice = [_sentinel("dc1-a", "dc1-b"), "redis://r2", _sentinel("DC1-B", "dc1-a")]
    assert "lists the same master twice (#1 and #3" in error_of(redlock_redis_urls=twice)
    again = [Sentinel([("s1", 26379)]).master_for("mymaster"), clients[0], "redis://r2"]
    assert "lists the same master twice (#1 and #2" in error_of(redlock_redis_urls=again)
    other_db = [_sentinel("dc1-a"), _sentinel("dc1-a", db=1), "redis://r2"]
    assert len(get_settings(make_app(redlock_redis_urls=other_db)).redis_urls) == 3


def test_passwords_never_appear_in_errors() -> None:
    masters = [
        "redis://user:s3cret@r1:6379/0",
        "redis://user:s3cret@r1:6379/0",
        "redis://:s3cret@r2:port/0",
        "http://:s3cret@r3",
        {"host": "r4", "password": "s3cret", "bogus": 1},
    ]
    for master in masters:
        message = error_of(redlock_redis_urls=[master, master])
        assert "s3cret" not in message
        assert "redlock_redis_urls" in message


def test_settings_repr_masks_passwords() -> None:
    settings = get_settings(make_app(redlock_redis_urls=["redis://u:s3cret@r1:6379/0"]))
    assert "s3cret" not in repr(settings)
    assert "redis://u:***@r1:6379/0" in repr(settings)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://u:pw@h:1/0", "redis://u:***@h:1/0"),
        ("redis://:pw@h", "redis://:***@h"),
        ("redis://:p@ss/word@h:1/0", "redis://:***@h:1/0"),
        ("redis://h:1/0?password=pw&db=1", "redis://h:1/0?password=***&db=1"),
        ("unix://u:pw@/run/redis.sock", "unix://u:***@/run/redis.sock"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_describe_master_omits_passwords() -> None:
    assert describe_master({"host": "h", "password": "pw"}) == "{host: 'h', port: 6379, db: 0}"
    described = describe_master(redis.Redis(host="h", port=7, password="pw"))
    assert described == "redis.Redis(h:7/0)"
    spec = {"sentinels": [("s1", 26379)], "service_name": "m", "password": "pw"}
    assert describe_master(spec) == "sentinel://s1:26379/m"


# -- unknown names --------------------------------------------------------------------------


def test_misspelled_setting_suggests_the_closest_name() -> None:
    assert error_of(redlock_tll=5) == (
        "unknown celery-redlock setting redlock_tll; did you mean redlock_ttl?"
    )


def test_misspelled_django_setting_suggests_the_django_spelling() -> None:
    with pytest.raises(ImproperlyConfigured) as caught:
        get_settings(django_app(CELERY_REDLOCK_NODE_TIMOUT=1))
    assert str(caught.value) == (
        "unknown celery-redlock setting CELERY_REDLOCK_NODE_TIMOUT; "
        "did you mean CELERY_REDLOCK_NODE_TIMEOUT?"
    )


def test_one_of_our_names_outside_the_namespace_is_a_warning_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # REDLOCK_TTL may be another library's: never read by us, so logged, not refused.
    with caplog.at_level(logging.WARNING, logger="celery_redlock.settings"):
        settings = get_settings(django_app(REDLOCK_TTL=5))
    assert settings.ttl == 30
    expected = (
        "setting REDLOCK_TTL is outside namespace 'CELERY' and never read by celery-redlock; "
        "write CELERY_REDLOCK_TTL if it is meant for celery-redlock"
    )
    assert [r.getMessage() for r in caplog.records] == [expected]


def test_another_librarys_redlock_setting_outside_the_namespace_is_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Issue 15 item 10: REDLOCK_RETRY_COUNT in a Django settings module stopped the worker.
    with caplog.at_level(logging.WARNING, logger="celery_redlock.settings"):
        settings = get_settings(
            django_app(REDLOCK_RETRY_COUNT=3, redlock_retry_delay=1, CELERY_REDLOCK_TTL=12)
        )
    assert settings.ttl == 12
    assert caplog.records == []


def test_typos_inside_the_namespace_are_still_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="did you mean CELERY_REDLOCK_DEDUPE"):
        get_settings(django_app(REDLOCK_RETRY_COUNT=3, CELERY_REDLOCK_DEDUP=None))


def test_a_django_spelling_without_a_namespace_is_reported_as_never_read() -> None:
    with pytest.raises(ImproperlyConfigured, match="write redlock_ttl"):
        get_settings(make_app(CELERY_REDLOCK_TTL=5))


def test_unrelated_settings_are_not_ours_to_judge() -> None:
    get_settings(make_app(redlockish=1, my_redlock_thing=2, task_acks_late=True))


def test_far_off_names_list_the_known_settings() -> None:
    (problem,) = find_unknown_settings(["redlock_zzzzzz"])
    assert problem.kind == "unknown"
    assert "known settings: redlock_redis_urls, redlock_key_prefix" in problem.message


# -- task options ---------------------------------------------------------------------------


def task_of(app: Celery, **options: Any) -> Task:
    def sync(account_id: int, day: str | None = None) -> None: ...

    task: Task = app.task(name="proj.sync", shared=False, **options)(sync)
    return task


def test_task_options_default_to_the_app_settings() -> None:
    app = make_app(redlock_ttl=20, redlock_on_contention="skip", redlock_max_contention_retries=3)
    options = validate_task_options(task_of(app), get_settings(app))
    assert options.task_name == "proj.sync"
    assert options.lock_ttl == 20
    assert options.renew_every == 20 / 3
    assert options.on_contention == "skip"
    assert options.contention_backoff == Backoff(1, 60)
    assert options.max_contention_retries == 3
    assert options.dedupe == "queued"
    assert options.on_lock_lost == "log"
    assert options.lock_key((42,), {}).startswith("proj.sync:")


def test_task_options_win_over_the_app_settings() -> None:
    app = make_app(redlock_ttl=20, redlock_dedupe="active", redlock_max_contention_retries=3)
    task = task_of(
        app,
        lock_key="report:{account_id}",
        lock_ttl=60,
        on_contention="raise",
        contention_backoff=(0.5, 5),
        max_contention_retries=None,
        dedupe=None,
        on_lock_lost="interrupt",
    )
    options = validate_task_options(task, get_settings(app))
    assert options.lock_ttl == 60
    assert options.renew_every == 20
    assert options.on_contention == "raise"
    assert options.contention_backoff == Backoff(0.5, 5)
    # None is a value of its own for these two: "no limit" and "no dedupe".
    assert options.max_contention_retries is None
    assert options.dedupe is None
    assert options.on_lock_lost == "interrupt"
    assert options.lock_key((42,), {}) == "report:42"


def test_unset_and_none_fall_back_where_none_means_nothing() -> None:
    app = make_app(redlock_ttl=20, redlock_dedupe="active")
    task = task_of(app, lock_ttl=None, on_contention=None, dedupe=UNSET)
    options = validate_task_options(task, get_settings(app))
    assert options.lock_ttl == 20
    assert options.on_contention == "retry"
    assert options.dedupe == "active"


def test_invalid_task_options_name_the_task_and_option() -> None:
    app = make_app()
    task = task_of(app, lock_ttl="30", on_contention="wait")
    with pytest.raises(ImproperlyConfigured) as caught:
        validate_task_options(task, get_settings(app))
    message = str(caught.value)
    assert message.startswith("2 problems in the lock options of task 'proj.sync':")
    assert (
        "task 'proj.sync': option lock_ttl must be a number of seconds in [0.01, 86400]" in message
    )
    assert "got '30' (a str)" in message
    assert "option on_contention must be one of 'retry', 'skip', 'raise'; got 'wait'" in message


def test_lock_ttl_must_leave_room_for_the_node_timeout() -> None:
    app = make_app(redlock_node_timeout=1)
    with pytest.raises(ImproperlyConfigured) as caught:
        validate_task_options(task_of(app, lock_ttl=2), get_settings(app))
    assert str(caught.value) == (
        "task 'proj.sync': option lock_ttl (2) must be more than three times "
        "redlock_node_timeout (Django: CELERY_REDLOCK_NODE_TIMEOUT) (1)"
    )


def test_lock_ttl_must_leave_room_for_an_explicit_renewal_period() -> None:
    app = make_app(redlock_renew_every=10)
    with pytest.raises(ImproperlyConfigured, match=r"is too short for a renewal every"):
        validate_task_options(task_of(app, lock_ttl=5), get_settings(app))


@pytest.mark.parametrize(
    ("ttl", "renew_every", "node_timeout", "drift"),
    [
        (30, 29.75, 0.2, 0.01),  # the default drift: validity 29.698 s
        (3, 2.5, 0.25, 0.3),  # a large drift: validity 2.098 s
    ],
)
def test_renew_every_must_land_within_the_validity_not_only_the_ttl(
    ttl: float, renew_every: float, node_timeout: float, drift: float
) -> None:
    """Review r10: renew_every + node_timeout < ttl was accepted, but a lease's validity
    ends at ttl - (ttl * clock_drift_factor + 2 ms): every lease was lost at its first
    renewal while its key lived on, and a second job of the key ran beside the first."""
    conf = {
        "redlock_ttl": ttl,
        "redlock_renew_every": renew_every,
        "redlock_node_timeout": node_timeout,
        "redlock_clock_drift_factor": drift,
    }
    message = error_of(redlock_redis_urls=THREE, **conf)
    assert "redlock_renew_every (Django: CELERY_REDLOCK_RENEW_EVERY)" in message
    assert "within the lease's validity" in message
    assert "clock drift allowance" in message
    # The same gap through a task's lock_ttl and a publish's redlock={"lock_ttl": ...}.
    app = make_app(
        redlock_redis_urls=THREE,
        redlock_ttl=100,  # fits; the task's and the publish's lock_ttl do not
        redlock_renew_every=renew_every,
        redlock_node_timeout=node_timeout,
        redlock_clock_drift_factor=drift,
    )
    settings = get_settings(app)
    with pytest.raises(ImproperlyConfigured, match=r"within the lease's validity"):
        validate_task_options(task_of(app, lock_ttl=ttl), settings)
    with pytest.raises(ImproperlyConfigured, match=r"within the lease's validity"):
        validate_call_options({"lock_ttl": ttl}, "proj.sync", settings)
    # A renewal that lands within the validity is fine.
    limit = ttl - (ttl * drift + 0.002) - 2 * node_timeout
    fitting = {**conf, "redlock_renew_every": limit * 0.99}
    get_settings(make_app(redlock_redis_urls=THREE, **fitting))


def test_misspelled_task_option_is_reported() -> None:
    app = make_app()
    with pytest.raises(ImproperlyConfigured) as caught:
        validate_task_options(task_of(app, lock_tll=5), get_settings(app))
    assert str(caught.value) == (
        "task 'proj.sync': unknown lock option lock_tll; did you mean lock_ttl?"
    )


def test_task_key_problems_are_reported_at_validation() -> None:
    app = make_app()
    with pytest.raises(ImproperlyConfigured, match="'acount_id', which is not an argument"):
        validate_task_options(task_of(app, lock_key="r:{acount_id}"), get_settings(app))
    other = make_app()
    with pytest.raises(ImproperlyConfigured, match=r"unique_on of task 'proj\.sync'"):
        validate_task_options(task_of(other, unique_on=["nope"]), get_settings(other))


def test_bound_task_key_ignores_self() -> None:
    app = make_app()

    @app.task(name="proj.bound", bind=True, shared=False, lock_key="acct:{account_id}")
    def bound(self: Task, account_id: int) -> None: ...

    options = validate_task_options(bound, get_settings(app))
    assert options.lock_key((9,), {}) == "acct:9"


def test_task_classes_validate_like_instances() -> None:
    class Report(Task):  # type: ignore[misc]  # celery ships no type information
        name = "proj.report"
        lock_key = "report:{account_id}"
        lock_ttl = 15

        def run(self, account_id: int) -> None: ...

    options = validate_task_options(Report, get_settings(make_app()))
    assert options.task_name == "proj.report"
    assert options.lock_ttl == 15
    assert options.lock_key((3,), {}) == "report:3"


def test_unknown_names_can_be_found_in_an_app_conf_directly() -> None:
    app = django_app(CELERY_REDLOCK_TTL=5, CELERY_REDLOCK_TLL=5)
    (problem,) = find_unknown_settings(app.conf)
    assert problem.setting == "CELERY_REDLOCK_TLL"
    assert "did you mean CELERY_REDLOCK_TTL?" in problem.message


def test_a_renewal_must_leave_room_for_two_rounds_and_a_default_one_too() -> None:
    """Review r11: a renewal is due ``renew_every`` after the reply to the round before
    it, while the validity counts from that round's send, so two rounds (each up to
    ``node_timeout``) must fit besides the interval: renew_every=0.73 with ttl 1 and
    node_timeout 0.25 was accepted and lost its lease at a renewal with 70 ms rounds. A
    TTL too short for its default interval (a third of it, at least 10 ms) was accepted
    and failed every task at its first run."""
    message = error_of(
        redlock_redis_urls=THREE,
        redlock_ttl=1,
        redlock_node_timeout=0.25,
        redlock_renew_every=0.73,
    )
    assert "(the interval must be < 0.488:" in message
    message = error_of(redlock_redis_urls=THREE, redlock_ttl=0.012, redlock_node_timeout=0.001)
    assert message.startswith("redlock_ttl (Django: CELERY_REDLOCK_TTL) (0.012) is too short")
    assert "a third of it, the default (0.01)" in message
    app = make_app(redlock_redis_urls=THREE, redlock_node_timeout=0.005)
    with pytest.raises(ImproperlyConfigured, match="a third of it, the default"):
        validate_task_options(task_of(app, lock_ttl=0.02), get_settings(app))
