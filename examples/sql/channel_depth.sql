SELECT * FROM my_queue.channel_stats() ORDER BY size DESC, channel LIMIT 20;
