"""TIDE: online adaptation of EAGLE3 speculative-decoding drafters."""
