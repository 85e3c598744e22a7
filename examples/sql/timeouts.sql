ALTER ROLE app_worker SET idle_in_transaction_session_timeout = '60s';
