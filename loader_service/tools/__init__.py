"""Operator tools that never run inside the service: the CLI, status view, sample data and demo."""
