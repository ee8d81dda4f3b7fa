"""Input pipelines and datasets."""
