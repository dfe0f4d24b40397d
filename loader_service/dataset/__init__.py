"""Pure dataset logic shared by the supervisor and the decode workers: the index and epoch plans."""
