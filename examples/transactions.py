import os

import psycopg

from lonnymq import Queue

dsn = os.environ["LONNYMQ_DSN"]
with Queue(dsn, schema="transactions_example") as q:
    q.install()
    with psycopg.connect(dsn) as conn:  # one transaction, committed at the end
        conn.execute("CREATE TEMPORARY TABLE orders (id int)")  # your business write
        conn.execute("INSERT INTO orders VALUES (17)")
        q.create(b"ship order 17", channel="shipping", conn=conn)

    # A pooled connection in a transaction: the message is finished with your side effects.
    message = q.dequeue(lock_ms=30_000)
    assert message is not None
    with q.transaction() as conn:
        conn.execute("SELECT 1")  # the side effect of handling the message
        message.delete(conn=conn)
