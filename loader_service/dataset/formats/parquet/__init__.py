"""Parquet files (as Hugging Face ``datasets`` writes them): the format (``source``) and one data
page of the image column read and decoded (``pages``)."""
