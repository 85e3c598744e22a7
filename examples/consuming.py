from lonnymq import AckStatus, Queue

with Queue(schema="consuming") as q:
    q.install()
    for n in range(5):
        q.create(f"job {n}".encode(), channel="jobs")

    # One message, locked for 30 s: finish it, give it back, or extend the lock.
    message = q.dequeue(lock_ms=30_000)  # None when nothing is ready
    assert message is not None
    message.heartbeat(lock_ms=30_000)  # still working: 30 s more from now
    message.defer(dequeue_at=q.now() + 5_000, state=b"page 3")  # again in 5 s, with state

    # Up to 3 at once; retry_at says when the next one is due if none is ready.
    batch = q.dequeue_batch(3, lock_ms=30_000)
    assert len(batch.messages) == 3
    statuses = q.delete_many(batch.messages)  # one call; a status per message
    assert statuses == [AckStatus.OK] * 3

    # Finish one and take the next in one transaction, as a busy consumer does.
    [last] = q.dequeue_many(1, lock_ms=30_000)
    following = q.complete_and_dequeue([last], lock_ms=30_000)
    assert following.completed == [AckStatus.OK]
    assert following.messages == []

    # The deferred message comes back with its state and its attempt count.
    print(q.stats())
