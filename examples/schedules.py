from lonnymq import Queue

with Queue(schema="schedules_example") as q:
    q.install()
    # Every five minutes, a message "build the report" in channel "reports".
    q.schedule("report", cron="*/5 * * * *", content=b"build the report", channel="reports")
    # Declaring it again with another cron replaces it.
    q.schedule("report", cron="0 * * * *", content=b"build the report", channel="reports")
    for s in q.schedules():
        print(s.name, s.cron, s.channel, s.next_at, s.last_fired_at)
    q.unschedule("report")
