"""Speculative decoding: draft, verify, accept (plain functions returning tokens and stats)."""
