"""The service's main process: the loop (service.py), the feeds and their slot pools, and its rooms:
trainers/, streams/, workers/ (with sizing/), edges/."""
