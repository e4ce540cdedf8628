"""The gateway application: composition of the router, the control plane and the agents
(:mod:`.app`), the OpenAI data plane (:mod:`.dataplane`), the admin app on the control port
(:mod:`.admin`, guarded by :mod:`.admin_guard`), usage and first-token accounting
(:mod:`.usage`, :mod:`.latency`) and API-key checks (:mod:`.bearer`)."""
