from semantic_cache.exact import CachedResponse, ExactCache
from semantic_cache.keys import exact_key, normalize_text

__all__ = ["CachedResponse", "ExactCache", "exact_key", "normalize_text"]
