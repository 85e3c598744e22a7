WITH clock AS (SELECT my_queue.epoch() AS now_ms)
SELECT count(m.id) AS messages,
       count(m.id) FILTER (WHERE m.is_locked) AS locked,
       count(m.id) FILTER (WHERE NOT m.is_locked AND m.dequeue_at <= c.now_ms) AS ready,
       count(m.id) FILTER (WHERE NOT m.is_locked AND m.dequeue_at > c.now_ms) AS scheduled,
       round((max(c.now_ms) - min(m.dequeue_at) FILTER (
           WHERE NOT m.is_locked AND m.dequeue_at <= c.now_ms)) / 1000.0, 1) AS oldest_ready_s
FROM clock c LEFT JOIN my_queue.message m ON TRUE;
