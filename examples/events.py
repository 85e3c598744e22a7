from lonnymq import Queue

with Queue(schema="events_example", event_channel="events_example") as q:
    q.install(archive=True)
    created = q.create(b"job", channel="jobs")
    assert created.id is not None

    message = q.dequeue(lock_ms=30_000)
    assert message is not None
    message.delete()

    # Wait until the message is finished (here it is already): None on timeout.
    outcome = q.wait(created.id, timeout=10)
    assert outcome is not None
    assert outcome.outcome == "completed"

    # Events published from the loop's start on: run it beside the producers, in a thread or
    # a process of its own. This one ends after 0.1 s of quiet.
    for event in q.events(timeout=0.1):
        print(event.type, event.channel, event.dequeue_at)
