from lonnymq import Queue

# Connected as the role that installs the queue; the three roles exist already
# (CREATE ROLE shop_api LOGIN PASSWORD '...').
with Queue(schema="shop") as owner:
    owner.install()
    owner.grant("shop_api", "producer")  # creates messages
    owner.grant("shop_worker", "worker")  # runs the Worker
    owner.grant("shop_ops", "admin")  # policies, schedules, the archive, verify
    print([(g.role, g.kind.value) for g in owner.grants()])
    owner.revoke("shop_ops")  # takes every right on the queue back
