import time

from lonnymq import Queue, StaleMessageError

with Queue(schema="errors_example") as q:
    q.install()
    q.create(b"slow job", channel="jobs")
    mine = q.dequeue(lock_ms=1)  # a lock that expires at once
    assert mine is not None
    time.sleep(0.01)  # (time passes)
    theirs = q.dequeue(lock_ms=30_000)  # the same message, taken again: attempt 2
    assert theirs is not None
    assert theirs.id == mine.id
    assert theirs.num_attempts == 2
    try:
        mine.delete()  # the first holder lost its lock: refused, nothing changed
    except StaleMessageError as err:
        print("lost the lock:", err)
    theirs.delete()
