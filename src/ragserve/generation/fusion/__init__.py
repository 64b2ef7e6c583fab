"""Cache fusion: reuse each keyed passage's KV at any position (CacheBlend / QCFuse)."""
