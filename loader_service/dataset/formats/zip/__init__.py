"""Zip archives of class folders: the format (``format``), the central directory read from the
archive's end (``central``), its members as the ImageFolder they would be if extracted (``tree``),
the index's columns (``members``) and a member read by range and checked (``reader``)."""
