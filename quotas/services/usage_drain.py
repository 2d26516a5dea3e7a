"""The spend pipeline's first half: each org's usage stream, drained into the hourly rollups.

Nothing that reached a stream is lost or counted twice:

- Entries are read through a consumer group, so an entry read and not acknowledged stays pending
  in the group: a drain that dies, or whose Postgres write fails, leaves its batch there, and the
  next drain reclaims it (XAUTOCLAIM) before it reads anything new.
- A batch is added to the rollups in one transaction, together with the stream's cursor (the newest
  entry applied). An entry at or before the cursor is acknowledged without being counted again: that
  is the worker killed after its commit and before its XACK.
- One drain at a time per stream (a Postgres advisory lock, held for the whole drain, released if
  the process dies). With one drainer reading pending entries first and then new ones, both in
  stream order, "at or before the cursor" means exactly "already applied". The lock can go
  unnoticed with its connection (a Postgres restart) while that drain still reads from Redis, so
  a batch is applied only when no older entry is pending: the cursor never passes an entry that
  another drain read and did not apply.
- One org's failure (Redis, Postgres) is logged and leaves its entries pending; the other orgs
  drain on.
- Once applied, entries are trimmed from the stream (XTRIM MINID): its memory stays bounded.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime

import redis
from django.conf import settings
from django.db import DatabaseError, connection, transaction

from quotas.engine.usage import EVENT_FIELD, add_to_rollups
from quotas.models import HourlySpend, Organization, RolledDay, StreamCursor
from quotas.models.spend import DIMENSIONS, MEASURES, column, columns
from quotas.services.engine import get_batch_redis, get_engine

log = logging.getLogger("quotas.drain")

GROUP = "rollups"
IDLE_CONSUMER_MS = 3_600_000  # a consumer (a drain process) idle this long with nothing pending is removed
# Advisory lock namespaces (the first key of pg_advisory_lock(int, int)).
STREAM_LOCK = 0x61710001  # one drain per stream
DAY_LOCK = 0x61710002  # a day's rollup against a drain adding to that day (quotas.services.rollups)


class DrainConflict(RuntimeError):
    """Another drain is (or was) at work on the stream: this one stops, its batch stays pending."""


@dataclass
class DrainResult:
    events: int = 0  # entries added to the rollups
    repeats: int = 0  # entries already applied (acknowledged without counting)
    batches: int = 0
    busy: list[str] = field(default_factory=list)  # streams another drain holds
    failed: dict[str, str] = field(default_factory=dict)  # stream -> what went wrong (its entries stay pending)

    def __iadd__(self, other: DrainResult) -> DrainResult:
        self.events += other.events
        self.repeats += other.repeats
        self.batches += other.batches
        self.busy += other.busy
        self.failed.update(other.failed)
        return self


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def drain_all(*, batch: int | None = None, max_seconds: float = 60.0, progress=None) -> DrainResult:
    """Drain every org's stream (orgs in Postgres, and any other whose policy is in Redis)."""
    engine = get_engine()
    orgs = set(Organization.objects.values_list("slug", flat=True))
    orgs.update(engine.client.smembers(engine.keys.org_index()))
    deadline = time.monotonic() + max_seconds
    total = DrainResult()
    for org in sorted(orgs):
        try:
            total += drain_org(org, batch=batch, deadline=deadline, progress=progress)
        except (DatabaseError, redis.RedisError, DrainConflict) as error:
            # One org's failure does not hold up the others; what it read stays pending for the next drain.
            log.exception("draining the usage stream of %s failed; its entries stay pending", org)
            total.failed[engine.keys.usage_stream(org)] = f"{type(error).__name__}: {error}"
    return total


def drain_org(org: str, *, batch: int | None = None, deadline: float | None = None, progress=None) -> DrainResult:
    """Drain one org's usage stream until it is empty (or the deadline passes)."""
    keys = get_engine().keys
    drain = _StreamDrain(
        get_batch_redis(), keys.usage_stream(org), keys.spent_agents(org),
        batch=batch or settings.QUOTAS_DRAIN_BATCH, progress=progress,
    )
    with _stream_lock(drain.stream) as locked:
        if not locked:
            return DrainResult(busy=[drain.stream])
        return drain.run(deadline)


class _StreamDrain:
    def __init__(self, client: redis.Redis, stream: str, spent_key: str, *, batch: int, progress=None):
        self.client = client
        self.stream = stream
        self.spent_key = spent_key
        self.batch = batch
        self.progress = progress
        self.consumer = consumer_name()
        self.result = DrainResult()

    def run(self, deadline: float | None) -> DrainResult:
        self._ensure_group()
        cursor, _ = StreamCursor.objects.get_or_create(stream=self.stream)
        self.last = (cursor.last_ms, cursor.last_seq)
        # 1. What earlier drains read and did not acknowledge (they died, or their write failed).
        start = "0-0"
        while True:
            start, entries, deleted = self.client.xautoclaim(
                self.stream, GROUP, self.consumer, min_idle_time=0, start_id=start, count=self.batch
            )[:3]
            if deleted:  # trimmed while pending: applied (only applied entries are trimmed)
                self.client.xack(self.stream, GROUP, *deleted)
            if entries:
                self._apply(entries, new=False)
            if start == "0-0":
                break
        # 2. What is new.
        while deadline is None or time.monotonic() < deadline:
            reply = self.client.xreadgroup(GROUP, self.consumer, {self.stream: ">"}, count=self.batch)
            entries = reply[0][1] if reply else []
            if not entries:
                break
            self._apply(entries, new=True)
        # 3. Trim what is applied. Everything before the cursor was applied: delivered in order,
        # and the cursor moves only in a committed transaction.
        if self.last != (0, 0):
            self.client.xtrim(self.stream, minid=f"{self.last[0]}-{self.last[1]}", approximate=False)
        self._forget_idle_consumers()
        return self.result

    def _forget_idle_consumers(self) -> None:
        """Consumers of processes gone (a name per host and pid) with nothing pending: drop them."""
        for consumer in self.client.xinfo_consumers(self.stream, GROUP):
            if consumer["name"] != self.consumer and consumer["pending"] == 0 and consumer["idle"] > IDLE_CONSUMER_MS:
                self.client.xgroup_delconsumer(self.stream, GROUP, consumer["name"])

    def _check_nothing_older_pending(self, batch_ids: list[str], first_fresh: str) -> None:
        """Refuse to apply a batch while an older entry outside it is pending: another drain read it (one
        that lost its lock with its connection) and may not have applied it. Applied past it, the cursor
        would make that entry look counted. The batch stays pending; the next drain takes both, in order."""
        older = self.client.xpending_range(self.stream, GROUP, min="-", max=first_fresh, count=len(batch_ids) + 1)
        ours = set(batch_ids)
        foreign = [entry for entry in older if entry["message_id"] not in ours]
        if foreign:
            raise DrainConflict(f"{self.stream}: entry {foreign[0]['message_id']} is pending with "
                                f"{foreign[0]['consumer']}, older than this batch")

    def _ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def _apply(self, entries: list, *, new: bool) -> None:
        ids = [entry_id for entry_id, _ in entries]
        fresh = [(entry_id, fields) for entry_id, fields in entries if _parse_id(entry_id) > self.last]
        if new and len(fresh) < len(entries):
            # New entries are never at or before the cursor, unless the stream was recreated with older
            # ids (a restore, a failover to a server whose clock is behind): say so, loudly.
            log.error("usage stream %s: %d new entries at or before the cursor %d-%d (stream reset?); not counted",
                      self.stream, len(entries) - len(fresh), *self.last)
        if fresh:
            self._check_nothing_older_pending(ids, fresh[0][0])
            totals: dict[tuple, list[int]] = {}
            for entry_id, fields in fresh:
                try:
                    add_to_rollups(totals, fields[EVENT_FIELD])
                except (KeyError, ValueError):
                    # Not an event of ours: counting it is impossible, keeping it would block the stream.
                    log.error("usage stream %s: entry %s is no usage event, skipped: %r", self.stream, entry_id, fields)
            agents = {key[4] for key in totals}
            if agents:  # before the write: after it, a failure here would leave them out for good
                self.client.sadd(self.spent_key, *agents)
            newest = _parse_id(fresh[-1][0])
            _write_batch(self.stream, self.last, newest, len(fresh), totals)
            self.last = newest
        self.client.xack(self.stream, GROUP, *ids)
        self.result.events += len(fresh)
        self.result.repeats += len(ids) - len(fresh)
        self.result.batches += 1
        if self.progress:
            self.progress(self.stream, self.result)


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def _write_batch(stream: str, expected: tuple[int, int], newest: tuple[int, int], events: int,
                 totals: dict[tuple, list[int]]) -> None:
    """Add a batch to the hourly rollups and move the stream's cursor, in one transaction.

    Durable: inside a caller's transaction it would be a savepoint, and the XACK after it would
    acknowledge what a rollback of that transaction could still undo.
    """
    with transaction.atomic(durable=True):
        cursor = StreamCursor.objects.select_for_update().get(stream=stream)
        if (cursor.last_ms, cursor.last_seq) != expected:
            raise DrainConflict(f"{stream}: cursor at {cursor.last_id}, expected {expected[0]}-{expected[1]}")
        if totals:
            days = sorted({datetime.fromtimestamp(key[1] // 1000, UTC).date() for key in totals})
            _lock_days(days)
            _upsert_hourly(totals)
            RolledDay.objects.filter(day__in=days).delete()  # a late event: read the day from its hours again
        cursor.last_ms, cursor.last_seq = newest
        cursor.events += events
        cursor.save(update_fields=["last_ms", "last_seq", "events", "updated_at"])


def _lock_days(days: list[date]) -> None:
    with connection.cursor() as cur:
        for day in days:  # in order: two transactions never wait on each other in a cycle
            cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", [DAY_LOCK, day.toordinal()])


_STAGE = "aq_spend_batch"  # a temporary table per session, emptied at each commit


def _upsert_hourly(totals: dict[tuple, list[int]]) -> None:
    """The batch's rows COPYed into a temporary table, then added with one INSERT ... ON CONFLICT.

    COPY of plain text lines costs a fraction of passing the rows as parameters (psycopg adapts
    those value by value in Python). Ids and model names cannot hold tabs, newlines or backslashes
    (quotas.vocabulary), but an entry written by anything else could: those are escaped.
    """
    table = HourlySpend._meta.db_table
    dims, measures = columns(DIMENSIONS), columns(MEASURES)
    lines = []
    for key, values in totals.items():
        text = "\t".join(map(str, key))
        if "\\" in text or "\n" in text or "\r" in text or text.count("\t") != len(key) - 1:
            text = "\t".join(_copy_escape(str(part)) for part in key)
        lines.append(text + "\t" + "\t".join(map(str, values)) + "\n")
    with connection.cursor() as cur:
        cur.execute(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE} (org text, hour_ms bigint, "
            + ", ".join(f"{d} text" for d in dims) + ", "
            + ", ".join(f"{m} bigint" for m in measures) + ") ON COMMIT DELETE ROWS"
        )
        # Emptied at each commit, but a drain inside an outer transaction commits only at its end.
        cur.execute(f"TRUNCATE {_STAGE}")
        with cur.copy(f"COPY {_STAGE} FROM STDIN") as copy:
            copy.write("".join(lines))
        selected = [f"{m} * 0.000000001" if m == column("cost") else m for m in measures]  # nano-USD -> USD, exact at any size
        cur.execute(
            f"INSERT INTO {table} (org, hour, {', '.join(dims)}, {', '.join(measures)}) "
            f"SELECT org, to_timestamp(hour_ms / 1000), {', '.join(dims)}, {', '.join(selected)} FROM {_STAGE} "
            f"ON CONFLICT (hour, org, {', '.join(dims)}) DO UPDATE SET "
            + ", ".join(f"{m} = {table}.{m} + EXCLUDED.{m}" for m in measures)
        )


def _copy_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


class _stream_lock:
    """A session advisory lock on one stream, tried without waiting; released on exit (or when the
    connection ends: a killed drain holds nothing)."""

    def __init__(self, stream: str):
        self.stream = stream
        self.locked = False

    def __enter__(self) -> bool:
        with connection.cursor() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))", [STREAM_LOCK, self.stream])
            self.locked = cur.fetchone()[0]
        return self.locked

    def __exit__(self, *exc) -> None:
        if not self.locked:
            return
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", [STREAM_LOCK, self.stream])
        except Exception:  # the connection is gone, and the lock with it
            connection.close()
