"""Prompt sets that ship with the package (data files, read with ``importlib.resources``)."""

DEFAULT_PROMPTS = "default_chat.jsonl"
