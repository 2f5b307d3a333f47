"""Stand-in processes for tests, importable as ``stubs.*``: pytest puts tests/ on sys.path for
tests/conftest.py (rootdir-relative "prepend" import mode, no tests/__init__.py)."""
