"""Issue 16: the beat settings (``redlock_beat_catch_up``) and explicit masters for a
non-Redis broker, validated at start with errors naming the setting."""

from __future__ import annotations

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

from celery_redlock.exceptions import ImproperlyConfigured
from celery_redlock.settings import get_settings


def _app(broker: str | None = None, **conf: object) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize("mode", ["one", "all", "none"])
def test_catch_up_modes_are_accepted(mode: str) -> None:
    assert get_settings(_app(redlock_beat_catch_up=mode)).beat_catch_up == mode


def test_catch_up_defaults_to_one() -> None:
    assert get_settings(_app()).beat_catch_up == "one"


@given(st.one_of(st.text(), st.integers(), st.none(), st.booleans()))
def test_any_other_catch_up_value_is_refused_naming_the_setting(value: object) -> None:
    if value in ("one", "all", "none"):
        return
    with pytest.raises(ImproperlyConfigured) as caught:
        get_settings(_app(redlock_beat_catch_up=value))
    message = str(caught.value)
    assert "redlock_beat_catch_up" in message
    assert "'one', 'all', 'none'" in message


@pytest.mark.parametrize(
    "broker",
    ["amqp://guest:secret@rabbit//", "sqs://", "sentinel://s1:26379", "pyamqp://h//"],
)
def test_non_redis_broker_needs_explicit_masters(broker: str) -> None:
    with pytest.raises(ImproperlyConfigured) as caught:
        get_settings(_app(broker))
    message = str(caught.value)
    assert "redlock_redis_urls" in message
    assert "not Redis" in message
    assert "secret" not in message


@pytest.mark.parametrize("broker", ["redis://h:1/0", "rediss://h:1/0", "unix:///tmp/r.sock", None])
def test_redis_broker_or_none_keeps_the_default(broker: str | None) -> None:
    assert get_settings(_app(broker)).redis_urls


def test_non_redis_broker_with_masters_set_is_fine() -> None:
    settings = get_settings(_app("amqp://h//", redlock_redis_urls=["redis://m:1/0"]))
    assert settings.redis_urls == ("redis://m:1/0",)


def test_beat_key_names_are_namespaced_by_app_and_anchors_recognised() -> None:
    from celery_redlock.beat import (
        anchor_key,
        beat_namespace,
        is_anchor_key,
        leader_key,
        occurrence_key,
    )
    from celery_redlock.keys import redis_key

    app = _app()
    assert beat_namespace(app) == "t"
    assert beat_namespace(Celery(set_as_current=False)) == "celery"
    assert occurrence_key("t", "cleanup#4") != occurrence_key("u", "cleanup#4")
    assert leader_key("t") == "beat:leader:t"
    anchor = redis_key("redlock", anchor_key("t", "cleanup"), "anchor:60")
    assert anchor == "redlock:{beat:t:cleanup}:anchor:60"
    assert is_anchor_key(anchor)
    assert is_anchor_key(b"redlock:{beat:cleanup}:anchor:60")  # the old layout
    assert not is_anchor_key(redis_key("redlock", occurrence_key("t", "cleanup#4"), "sent"))
    assert not is_anchor_key("redlock:{report:42}:anchor:1")
