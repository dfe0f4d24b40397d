"""Where a dataset's bytes come from: local files (``local``) or an object store (``objectstore``,
read by a worker through ``objectfiles``, listed and fetched for a scan through ``objectfolder``,
kept across restarts by ``cachedir``). ``files.open_files`` is the one place that tells them apart
for a reader: a format names files and byte ranges, whatever holds them."""
