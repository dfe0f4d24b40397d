"""How many decode workers take tasks (--workers auto): the rule and its place in the main loop."""
