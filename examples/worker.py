from lonnymq import Message, Queue
from lonnymq.worker import Backoff, Worker


def handle(message: Message) -> None:
    # Return to finish the message; raise to retry it later (with backoff).
    print("sending", message.content, "to", message.channel)


with Queue(schema="worker_example") as q:
    q.install()
    q.create(b"welcome e-mail", channel="tenant-1")
    worker = Worker(
        q,
        handle,
        concurrency=8,  # handlers at once
        lock_ms=30_000,  # renewed while the handler runs
        max_attempts=5,  # then the message is failed (archived when the archive is on)
        backoff=Backoff(base_ms=1_000, max_ms=300_000),
    )
    stats = worker.run(until_idle=True)  # run() serves until SIGTERM or SIGINT
    print(stats)
