"""What the outside world sees of the service: its endpoint and CURVE, systemd, status, metrics,
the stdin lifeline."""
