"""Drafter operations: swap watcher, collapse guard, promote/rollback."""
