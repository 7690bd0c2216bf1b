"""Accounts, and a log of task runs that the task bodies write themselves."""

from __future__ import annotations

from django.db import models


class Account(models.Model):
    name = models.CharField(max_length=100)
    balance = models.IntegerField(default=0, help_text="in cents")
    synced_at = models.DateTimeField(null=True, blank=True)
    # The newest fencing token that wrote this row: a write with an older (or the same)
    # token comes from a task that lost its lock, and is refused (see tasks.apply_payment).
    # Tokens are about 1.7e15, hence a 64-bit column.
    fence = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}: {self.balance / 100:.2f}"


class TaskRun(models.Model):
    """One run of a task body: when it started and ended, where, with which fence."""

    task = models.CharField(max_length=100)
    task_id = models.CharField(max_length=64, db_index=True)
    account_id = models.IntegerField(null=True)
    worker = models.CharField(max_length=200)
    pid = models.IntegerField()
    started = models.FloatField(help_text="wall clock, seconds since the epoch")
    finished = models.FloatField(null=True, help_text="null: the run never finished")
    fence = models.BigIntegerField(null=True)
    occurrence = models.CharField(max_length=200, blank=True, help_text="beat occurrence")
    outcome = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ("started",)

    def __str__(self) -> str:
        return f"{self.task}[{self.task_id}] on {self.worker} pid {self.pid}"
