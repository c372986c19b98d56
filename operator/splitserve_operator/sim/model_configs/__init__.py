"""Hugging Face ``config.json`` files of well-known models.

Written from their public architecture numbers (no hub is reachable from here).
"""
