"""The long-running processes (engine, ingest, scheduler): ``python -m tide.services.<name>`` or
``tide serve|ingest|scheduler``. Each main loads config, builds its objects, runs until SIGTERM and
closes in ``finally``; the shared start is tide/service.py."""
