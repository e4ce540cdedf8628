"""What llmgw knows about engine servers whoever runs them: how to observe one (:mod:`llmgw.engines.probe`).

Both the agent (which supervises engines) and the router (which sends them
requests) import it; it builds on the HTTP transport only.
"""
