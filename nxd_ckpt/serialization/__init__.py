"""Encodings of one state file: plain ``torch.save`` and torch_xla's xser layout. No storage access here."""
