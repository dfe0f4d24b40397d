"""The service process: main loop, trainer sessions, task scheduling, slot pools and worker supervision."""
