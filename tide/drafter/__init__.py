"""EAGLE3 drafter: model, vocab mapping, artifact format."""
