"""The decode-worker process: takes tasks, decodes images (OpenCV or the region decoder) into slots."""
