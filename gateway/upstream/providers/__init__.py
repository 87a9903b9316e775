"""Backend kinds: one small module each, behind the Provider protocol in base.py."""
