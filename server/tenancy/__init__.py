"""Who may call and how much: the tenant file and API keys (:mod:`.tenants`) and the tenants'
rate limits, token buckets in Redis with a node-local fallback (:mod:`.ratelimit`)."""
