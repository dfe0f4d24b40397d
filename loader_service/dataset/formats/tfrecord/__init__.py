"""TFRecord files of ``tf.train.Example`` records, read without TensorFlow: the format (``format``),
the records' framing and checksums (``framing``, ``crc``), an Example's features (``example``),
the index's columns (``records``) and a record read by range and checked (``reader``)."""
