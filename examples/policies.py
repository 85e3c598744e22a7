from lonnymq import Queue

with Queue(schema="policies") as q:
    q.install()
    tenant = q.channel("tenant-big")
    # At most 4 messages locked at once, 50 ms between two dequeues, 10,000 held at most.
    tenant.set_policy(max_concurrency=4, release_interval_ms=50, max_size=10_000)

    q.channel("dead").set_policy(max_concurrency=0)  # paused: nothing leaves it

    for stats in q.stats():  # channels that hold messages or have a policy
        print(stats.channel, stats.size, stats.in_flight, stats.policy)

    tenant.clear_policy()  # unlimited again
