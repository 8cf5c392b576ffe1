"""The Dask task-graph plan (``"distributed"``): blocks of the NumPy and Array-API paths."""
