from lonnymq import CreateStatus, NewMessage, Queue

with Queue(schema="producing") as q:
    q.install()

    # One message; the channel is created on the way (no channel: "default").
    result = q.create(b'{"order": 17}', channel="tenant-1")
    assert result.status is CreateStatus.CREATED
    assert result.id is not None

    # Not before a given time (ms since the Unix epoch, on the database clock).
    q.create(b"reminder", channel="tenant-1", dequeue_at=q.now() + 3_600_000)

    # Ahead of the channel's other waiting messages: priority 0 goes first.
    q.create(b"urgent", channel="tenant-1", priority=0)

    # A dedup key makes a retried create harmless while the first message is waiting.
    first = q.create(b"invoice 9", channel="tenant-1", dedup_key="invoice-9")
    again = q.create(b"invoice 9", channel="tenant-1", dedup_key="invoice-9")
    assert again.status is CreateStatus.DEDUPLICATED
    assert again.id == first.id

    # Many messages in one call and one transaction; results in input order.
    results = q.create_many(
        [NewMessage(b"a", channel="tenant-2"), NewMessage(b"b", channel="tenant-3")]
    )
    assert [r.status for r in results] == [CreateStatus.CREATED, CreateStatus.CREATED]

    # Through a channel handle, and refused (not raised) when the channel is full.
    small = q.channel("tenant-4")
    small.set_policy(max_size=1)
    small.create(b"fits")
    assert small.create(b"does not").status is CreateStatus.DROPPED
