"""The decode workers: the pool, the tasks they get, and how many take them."""
