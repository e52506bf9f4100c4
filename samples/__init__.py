"""Sample model and media for the pipeline, fetched from PyPI packages (see samples.fetch)."""
