from lonnymq import CreateStatus, Queue


def test_create_dequeue_delete_round_trip(queue: Queue) -> None:
    created = queue.create(b"hello", channel="a")
    assert created.status is CreateStatus.CREATED
    message = queue.dequeue(lock_ms=10_000)
    assert message is not None
    assert (message.id, message.content, message.num_attempts) == (created.id, b"hello", 1)
    message.delete()
    assert queue.dequeue(lock_ms=10_000) is None
    assert queue.stats() == []
