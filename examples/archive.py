from lonnymq import Queue

with Queue(schema="archive_example") as q:
    q.install(archive=True)  # keep every finished message
    q.create(b"print the label", channel="labels")
    message = q.dequeue(lock_ms=30_000)
    assert message is not None
    message.fail(error="out of paper")  # finished as failed

    [failed] = q.archived(outcome="failed")  # newest first
    print(failed.id, failed.channel, failed.error, failed.num_attempts)
    [replayed] = q.replay([failed.id])  # a new message, same channel and content
    print(replayed)
