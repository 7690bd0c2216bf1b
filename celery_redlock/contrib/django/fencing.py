"""Fenced row updates with the Django ORM: a stale lock holder's write is refused.

Give the model a fence column (``fence = models.BigIntegerField(default=0)``; tokens
are about 1.7e15 today, too big for an ``IntegerField``) and write through
:func:`fenced_update` with the running task's ``self.lease.fence``::

    @app.task(bind=True, base=SingletonTask, lock_key="account:{account_id}")
    def apply_payment(self, account_id, amount):
        fenced_update(Account, account_id, self.lease.fence, balance=F("balance") + amount)

The check and the write are one ``UPDATE ... WHERE pk = %s AND fence < %s``, so
the database itself refuses a holder that lost its lock while paused. See
:mod:`celery_redlock.fencing` for the rule (strictly newer; one write per lease).
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model, Q, QuerySet

from celery_redlock.exceptions import StaleFence

__all__ = ["fenced_update"]


def _queryset(queryset_or_model: Any) -> Any:
    if isinstance(queryset_or_model, QuerySet):
        return queryset_or_model
    if isinstance(queryset_or_model, type) and issubclass(queryset_or_model, Model):
        model: Any = queryset_or_model
        return model._default_manager.all()
    raise TypeError(f"expected a model class or a QuerySet, got {queryset_or_model!r}")


def fenced_update(
    queryset_or_model: Any,
    pk: Any,
    fence: int,
    fence_field: str = "fence",
    **values: Any,
) -> int:
    """Update the row ``pk`` with ``values`` and ``fence`` if its stored fence is older.

    Runs ``UPDATE ... SET <values>, <fence_field> = fence WHERE pk = pk AND
    (<fence_field> < fence OR <fence_field> IS NULL)`` as one statement (``values``
    may use ``F()`` expressions). ``queryset_or_model`` may be a filtered queryset:
    rows outside it count as missing. Returns 1 (rows updated).

    :raises StaleFence: the row's fence is equal to or newer than ``fence``
        (``exc.fence``, ``exc.current``); nothing was written.
    :raises Model.DoesNotExist: no row with that pk (in that queryset).
    :raises TypeError: ``fence`` is not a non-negative int.
    :raises ValueError: ``values`` is empty or sets the fence field itself.
    """
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        raise TypeError(f"fence must be a non-negative int (lease.fence), got {fence!r}")
    if not values:
        raise ValueError("fenced_update: give at least one field to write")
    if fence_field in values:
        raise ValueError(f"{fence_field!r} is the fence field; it is written for you")
    queryset = _queryset(queryset_or_model)
    older = Q(**{f"{fence_field}__lt": fence}) | Q(**{f"{fence_field}__isnull": True})
    updated: int = queryset.filter(older, pk=pk).update(**values, **{fence_field: fence})
    if updated:
        return updated
    model = queryset.model
    current = queryset.filter(pk=pk).values_list(fence_field, flat=True).first()
    if current is None and not queryset.filter(pk=pk).exists():
        raise model.DoesNotExist(f"{model._meta.label} with pk={pk!r} does not exist")
    raise StaleFence(
        f"update of {model._meta.label} pk={pk!r} refused: fence {fence} is not newer "
        f"than {current}",
        f"{model._meta.label}:{pk}",
        [],
        None,
        fence,
        current,
    )
