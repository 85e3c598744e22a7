import time

from lonnymq import NewMessage, Queue

with Queue(schema="quickstart") as q:  # $LONNYMQ_DSN, else the embedded PostgreSQL
    q.install()  # creates or upgrades the schema; safe to run every time
    q.channel("tenant-42").set_policy(max_concurrency=2, release_interval_ms=100)

    q.create(b"resize image 1", channel="tenant-42")
    q.create(b"urgent", channel="tenant-42", priority=0)  # goes ahead of the channel's others
    q.create(b"in a second", channel="tenant-7", dequeue_at=q.now() + 1_000)
    q.create_many([NewMessage(b"a", channel="tenant-7"), NewMessage(b"b")])

    while sum(s.size for s in q.stats()) > 0:  # until every message is finished
        batch = q.dequeue_batch(10, lock_ms=30_000)  # locks up to 10 messages
        for message in batch.messages:
            print(message.channel, message.content, "attempt", message.num_attempts)
            message.delete()  # done; message.defer(...) would retry it later
        if not batch.messages and batch.retry_at is not None:
            time.sleep(max(0, batch.retry_at - q.now()) / 1000)  # the next one is due then
