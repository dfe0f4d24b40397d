"""Hugging Face ``datasets.save_to_disk`` folders: the format (``format``), the index walked from
the Arrow record batches (``scan``), its columns (``rows``) and an image read by range (``reader``)."""
