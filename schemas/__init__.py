"""The capture record and dataset JSON schemas, installed as the package data of ``tide.schemas``
(pyproject.toml package-dir): read them with ``importlib.resources.files("tide.schemas")``."""
