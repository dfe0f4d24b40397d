"""Tar shards (WebDataset-style): the format (``format``), which shards ``--data`` names (``shards``),
the careful and the fast scan of their headers (``headers``, ``fast``), members grouped into samples
(``samples``)."""
