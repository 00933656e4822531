"""kvd: a KV-cache block manager daemon for LLM inference engines."""

__version__ = "0.1.0"
