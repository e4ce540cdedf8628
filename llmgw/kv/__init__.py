"""KV-cache plumbing: block keys, the KV event codec, ZMQ under Trio, mirrors and indexes."""
